"""`omnidesk doctor`: all checks run, none raises, failures come with fixes."""

from __future__ import annotations

import builtins
import sys

import pytest

from omnidesk import doctor
from omnidesk.doctor import Check, format_report, run_checks

NAMES = ["Python", "torch", "GPU", "decode steps", "PortAudio", "audio devices", "webrtcvad", "echo cancellation", "end of turn",
         "Qt display", "models", "demo model"]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "hub"


def _by_name(checks):
    return {c.name: c for c in checks}


def test_all_checks_run(empty_cache):
    checks = run_checks()
    assert [c.name for c in checks] == NAMES
    for c in checks:
        assert isinstance(c, Check) and isinstance(c.ok, bool) and c.detail
        assert c.ok or c.fix or c.detail.startswith("check failed")
    c = _by_name(checks)
    assert c["Python"].ok
    assert not c["models"].ok and "omnidesk models download Qwen/Qwen2.5-Omni-3B" in c["models"].fix
    assert str(empty_cache) in c["models"].detail
    report = format_report(checks)
    for check in checks:
        assert check.name in report
        if not check.ok and check.fix:
            assert f"fix: {check.fix}" in report


def test_fake_hf_cache_model_found(empty_cache):
    snap = empty_cache / "models--Qwen--Qwen2.5-Omni-3B" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "qwen2_5_omni"}')
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("a" * 40)
    # the published Moshi layout has no config.json: its three files say what it is
    moshi = empty_cache / "models--kyutai--moshiko-pytorch-bf16" / "snapshots" / ("b" * 40)
    moshi.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors", "tokenizer_spm_32k_3.model"):
        (moshi / name).write_bytes(b"")
    # a download stopped before any file landed
    (empty_cache / "models--Qwen--Qwen2.5-Omni-7B" / "blobs").mkdir(parents=True)
    check = doctor.check_models()
    assert check.ok
    assert "Qwen/Qwen2.5-Omni-3B (Qwen2.5-Omni)" in check.detail
    assert "kyutai/moshiko-pytorch-bf16 (Moshi)" in check.detail
    assert "incomplete: Qwen/Qwen2.5-Omni-7B" in check.detail
    assert "✓ models" in format_report([check])


def test_portaudio_missing(empty_cache, monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "sounddevice":
            raise OSError("PortAudio library not found")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    checks = _by_name(run_checks())
    assert not checks["PortAudio"].ok and "libportaudio2" in checks["PortAudio"].fix
    assert not checks["audio devices"].ok
    assert "apt-get install libportaudio2" in format_report(list(checks.values()))


def test_sounddevice_not_installed(empty_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # import raises ImportError
    checks = _by_name(run_checks())
    assert not checks["PortAudio"].ok and "pip install sounddevice" in checks["PortAudio"].fix


def test_no_audio_devices(monkeypatch):
    class FakeSD:
        def query_devices(self, kind=None):
            if kind:
                raise RuntimeError("no default device")
            return [{"name": "hdmi", "max_input_channels": 0, "max_output_channels": 2}]

    monkeypatch.setattr(doctor, "_sounddevice", lambda: FakeSD())
    check = doctor.check_audio_devices()
    assert not check.ok and "0 input / 1 output" in check.detail and "microphone" in check.fix


def test_no_display(monkeypatch):
    for var in ("QT_QPA_PLATFORM", "DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    check = doctor.check_qt()
    assert not check.ok and doctor.QT_NO_DISPLAY in check.detail and "Xvfb" in check.detail


def test_a_crashing_check_is_reported_not_raised(monkeypatch):
    def boom():
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(doctor, "CHECKS", [("GPU", boom), ("Python", doctor.check_python)])
    checks = run_checks()
    assert [c.name for c in checks] == ["GPU", "Python"]
    assert not checks[0].ok and "driver exploded" in checks[0].detail
    assert "✗ GPU" in format_report(checks)


def test_decode_steps_says_which_mode_runs_and_what_compiling_needs(monkeypatch):
    import shutil

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("OMNIDESK_COMPILE", "off")
    c = doctor.check_decode()
    assert c.ok and c.detail.startswith("eager on the CPU (--compile off)")
    monkeypatch.setenv("OMNIDESK_COMPILE", "auto")
    c = doctor.check_decode()
    assert c.ok and "compiled on the CPU for qwen2_5_omni, qwen3_omni, eager for the rest" in c.detail
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no C++ compiler: compiling would fail
    c = doctor.check_decode()
    assert not c.ok and "no C++ compiler" in c.detail and "g++" in c.fix


def test_gpu_needs_are_the_loaders_estimate():
    """What doctor says a model needs is the loader's own estimate (bf16, the loader's default context) of the
    published config, the figure it refuses to load by: one source, recomputed here from tests/data."""
    from pathlib import Path

    import torch

    from omnidesk.models.families import RECOMMENDED
    from omnidesk.models.moshi.config import MOSHI_7B
    from omnidesk.models.moshi.executor import estimate_memory as moshi_estimate
    from omnidesk.models.qwen2_5_omni.config import OmniConfig
    from omnidesk.models.qwen2_5_omni.memory import estimate_memory as qwen_estimate
    from omnidesk.models.qwen3_omni.config import Qwen3OmniConfig
    from omnidesk.models.qwen3_omni.memory import estimate_memory as qwen3_estimate

    data = Path(__file__).parent / "data"
    bf16 = torch.bfloat16
    q3b = OmniConfig.from_file(data / "qwen2_5_omni_3b" / "config.json")
    q7b = OmniConfig.from_file(data / "qwen2_5_omni_7b" / "config.json")
    q3 = Qwen3OmniConfig.from_file(data / "qwen3_omni" / "config.json")
    expected = {  # the loaders' defaults: 8192 tokens (Qwen), the config's 3000 frames (Moshi)
        "Qwen/Qwen2.5-Omni-3B": qwen_estimate(q3b, bf16, 8192),
        "Qwen/Qwen2.5-Omni-7B": qwen_estimate(q7b, bf16, 8192),
        "Qwen/Qwen2.5-Omni-7B-GPTQ-Int4": qwen_estimate(q7b, bf16, 8192, quantization="int4", group_size=128),
        "Qwen/Qwen2.5-Omni-7B-AWQ": qwen_estimate(q7b, bf16, 8192, quantization="int4", group_size=128),
        "kyutai/moshiko-pytorch-bf16": moshi_estimate(MOSHI_7B, bf16),
        "kyutai/moshika-pytorch-bf16": moshi_estimate(MOSHI_7B, bf16),
        "Qwen/Qwen3-Omni-30B-A3B-Instruct": qwen3_estimate(q3, bf16, 8192),
    }
    assert set(expected) == set(RECOMMENDED)
    for repo, estimate in expected.items():
        assert RECOMMENDED[repo].gpu_memory_gb == round(estimate.total / 1e9, 1), (repo, estimate.total)
    needs = doctor._gpu_needs()
    assert "17.6 GB for Moshi" in needs and "78.5 GB for Qwen3-Omni" in needs and "12.8 GB for Qwen2.5-Omni-3B" in needs
    assert "24 GB" not in needs and "80 GB" not in needs
