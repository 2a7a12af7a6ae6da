"""Qwen2.5-Omni (3B, 7B): audio encoder -> thinker (LLM) -> talker (speech tokens) -> DiT + BigVGAN vocoder."""
