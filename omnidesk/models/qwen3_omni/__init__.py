"""Qwen3-Omni-30B-A3B: thinker, talker, code predictor and code2wav vocoder."""
