"""The built-in demo checkpoint: layout, size, ids unlike the real model's, determinism, a full turn."""

import hashlib
import subprocess
import sys
from pathlib import Path

import torch

from omnidesk.models.qwen2_5_omni.config import OmniConfig
from omnidesk.models.qwen2_5_omni.demo import DEMO_NOTICE, is_demo, make_demo
from omnidesk.models.qwen2_5_omni.loading import load_stack
from omnidesk.models.qwen2_5_omni.offline import generate_reply

REAL_7B = Path(__file__).parent / "data" / "qwen2_5_omni_7b" / "config.json"
HUB_FILES = {"config.json", "generation_config.json", "model.safetensors", "spk_dict.pt", "tokenizer.json",
             "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json",
             "chat_template.json", "preprocessor_config.json"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_demo_layout_size_and_determinism(tmp_path):
    a = make_demo(tmp_path / "a")
    b = make_demo(tmp_path / "b")
    assert {p.name for p in a.iterdir()} == HUB_FILES
    assert sum(p.stat().st_size for p in a.iterdir()) < 20e6
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(a / name) == _sha(b / name), name
    assert make_demo(tmp_path / "a") == a  # reused, not rewritten


def test_demo_special_ids_differ_from_real_model(tmp_path):
    demo = OmniConfig.from_file(make_demo(tmp_path / "d") / "config.json")
    real = OmniConfig.from_file(REAL_7B)
    for field in ("audio_token_id", "audio_start_token_id", "audio_end_token_id"):
        assert getattr(demo.thinker, field) != getattr(real.thinker, field), field
    for field in ("codec_bos_id", "codec_eos_id", "codec_pad_id", "codec_mask_id", "text_bos_id", "text_eos_id",
                  "text_pad_id"):
        assert getattr(demo.talker, field) != getattr(real.talker, field), field


def test_demo_runs_a_turn_and_says_it_is_noise(tmp_path, speech_like):
    stack = load_stack(make_demo(tmp_path / "d"))
    assert is_demo(stack.config.raw) and "noise" in DEMO_NOTICE
    assert set(stack.voices) == {"Chelsie", "Ethan"}
    reply = generate_reply(stack, speech_like(1.2), max_text_tokens=10, max_codec_tokens=40, seed=0)
    assert len(reply.text_ids) == 10 or reply.text_ids[-1] in (stack.tokenizer.special_ids["im_end"],)
    assert 0 < len(reply.codec_ids) <= 40
    assert all(0 <= c < stack.config.talker.decoder.vocab_size for c in reply.codec_ids)


def test_cli_make_demo_and_default_command(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "omnidesk", "models", "make-demo"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "noise" in out.stdout and "MB" in out.stdout
    out = subprocess.run([sys.executable, "-m", "omnidesk"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "noise" in out.stdout and "speech tokens" in out.stdout


def test_cli_reply_on_a_silent_44khz_file_names_the_file(tmp_path):
    """Any rate is resampled now (tests/test_cli.py); a file without speech is still refused by name."""
    import numpy as np
    import soundfile as sf

    wav = tmp_path / "q44.wav"
    sf.write(str(wav), np.zeros((4410, 2), dtype="float32"), 44100)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "omnidesk", "reply", "--model", "demo", "--input", str(wav)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "no speech detected" in out.stderr and "q44.wav" in out.stderr and "Traceback" not in out.stderr


def test_cli_reply_on_missing_checkpoint_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "omnidesk", "reply", "--model", str(tmp_path / "nope"), "--input",
                          "x.wav"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "checkpoint directory not found" in out.stderr and "Traceback" not in out.stderr


def test_demo_reply_is_clearly_audible(tmp_path, speech_like):
    stack = load_stack(make_demo(tmp_path / "d"))
    reply = generate_reply(stack, speech_like(1.0), max_text_tokens=8, max_codec_tokens=120, seed=1)
    v = stack.voices["Ethan"]
    wave = stack.vocoder.offline(torch.tensor(reply.codec_ids), stack.vocoder.voice(v.cond, v.ref_mel), seed=1)
    rms = wave.pow(2).mean().sqrt().item()
    assert rms >= 0.05, rms
    assert wave.abs().max() <= 1.0
