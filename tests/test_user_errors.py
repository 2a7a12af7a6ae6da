"""What users break, as a new user would (issue 23): each failure is one clear line naming the file,
nothing is half-written, nothing is lost."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import torch

from omnidesk import cli
from omnidesk.models.checkpoint import CheckpointError, VerifyReport, check_values
from omnidesk.models.qwen2_5_omni.demo import make_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return make_demo(tmp_path_factory.mktemp("demo") / "demo")


@pytest.fixture
def bad(demo, tmp_path) -> Path:
    """A private, damageable copy of the demo checkpoint."""
    dst = tmp_path / "bad"
    shutil.copytree(demo, dst)
    return dst


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _poison(path: Path, at: int = 100_000, n: int = 4000) -> None:
    """0xFF over ``n`` bytes of tensor data (NaN/Inf in whatever float tensor lies there)."""
    with open(path, "r+b") as f:
        (header,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header + at)
        f.write(b"\xff" * n)


# ---------------------------------------------------------------- 3. corrupt weights

def test_verify_finds_nan_and_inf_values_and_names_the_tensor(capsys, bad):
    _poison(bad / "model.safetensors")
    rc, out, _ = _run(capsys, "models", "verify", bad, "--no-load-test")
    assert rc == 1
    problems = [line for line in out.splitlines() if line.strip().startswith("!!")]
    assert len(problems) == 1 and "hold NaN or Inf values" in problems[0] and "model.safetensors" in problems[0]
    assert "tensor(s)" in problems[0] and "'" in problems[0]  # the tensor is named
    assert "verified: no problems" not in out


def test_the_value_check_reads_every_float_tensor_and_passes_a_good_file(demo):
    report = VerifyReport(demo)
    seen = []
    report.progress = lambda done, total: seen.append((done, total))
    assert check_values([demo / "model.safetensors"], report)
    assert not report.problems and any("no NaN or Inf" in c for c in report.checked)
    assert seen and seen[-1][0] <= seen[-1][1] and seen == sorted(seen)


def test_loading_a_tensor_with_nan_names_it(bad):
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    _poison(bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.+' holds NaN or Inf values"):
        load_stack(bad)


def test_reply_writes_no_half_file_when_it_fails(capsys, bad, tmp_path, monkeypatch):
    """The output is written to a temporary name and renamed at the end: a failure while writing
    leaves nothing under the user's name."""
    import soundfile as sf

    def broken(path, *a, **k):
        Path(path).write_bytes(b"RIFF half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf, "write", broken)
    out = tmp_path / "answer.wav"
    with pytest.raises(OSError):
        cli.write_wav(str(out), torch.zeros(100).numpy(), 24000)
    assert not out.exists() and not list(tmp_path.glob(".answer.wav.part*"))


# ---------------------------------------------------------------- 4. malformed config.json

def test_malformed_config_is_named_with_line_and_column(capsys, bad, tmp_path):
    (bad / "config.json").write_text('{"broken": \n')
    wav = Path(__file__).parent / "fixtures" / sorted(p.name for p in (Path(__file__).parent / "fixtures").glob("*.wav"))[0]
    rc, out, err = _run(capsys, "reply", "--model", bad, "--input", wav)
    assert rc == 2
    assert f"{bad / 'config.json'}: not valid JSON" in err and "line 2, column 1" in err
    assert "no config.json" not in err and len(err.strip().splitlines()) == 1
    rc, out, err = _run(capsys, "models", "verify", bad)
    assert rc == 2 and "not valid JSON" in err and "line 2" in err


# ---------------------------------------------------------------- 5. bench --out where nothing can be written

def test_bench_out_is_checked_before_the_benchmark_runs(capsys, demo, monkeypatch):
    ran = []
    monkeypatch.setattr("omnidesk.cli.check._prepare", lambda *a, **k: ran.append(1))
    target = Path("/proc/omnidesk-bench/out.json")  # no folder can be made there, even by root
    rc, out, err = _run(capsys, "bench", "--model", demo, "--out", target)
    assert rc == 2 and not ran
    assert err.startswith("error: --out /proc/omnidesk-bench/out.json") and len(err.strip().splitlines()) == 1
    read_only = Path("/sys")  # a read-only file system: access() says yes to root, a write does not
    if read_only.is_dir():
        rc, out, err = _run(capsys, "bench", "--model", demo, "--out", read_only / "bench.json")
        assert rc == 2 and not ran and "--out /sys/bench.json" in err


# ---------------------------------------------------------------- 6. faint noise is not speech

def _faint_noise(seconds: float = 30.0, rate: int = 16000):
    """What `sox -n -r 16000 noise.wav synth 30 whitenoise vol -60dB` writes: white noise at -70 dBFS RMS
    (peaks near -58 dBFS)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.standard_normal(int(seconds * rate)) * 10 ** (-70 / 20)).astype(np.float32)


def test_the_file_check_hears_no_speech_in_faint_noise_from_its_first_frame():
    from omnidesk.audio.vad import FILE_FLOOR_DBFS, WebRtcVAD, WebRtcVADConfig

    noise = _faint_noise()
    frames = [noise[i * 640:(i + 1) * 640] for i in range(noise.size // 640)]
    plain = WebRtcVAD(2, 16000)  # webrtcvad adapting to the noise at the start of a stream
    assert sum(plain.is_speech(f) for f in frames) == 3
    checked = WebRtcVAD(sample_rate=16000, config=WebRtcVADConfig(floor_dbfs=FILE_FLOOR_DBFS))
    assert sum(checked.is_speech(f) for f in frames) == 0


def test_a_file_of_faint_noise_is_refused_like_silence(capsys, demo, tmp_path):
    import soundfile as sf

    path = tmp_path / "noise.wav"
    sf.write(str(path), _faint_noise(), 16000, subtype="PCM_16")
    rc, out, err = _run(capsys, "reply", "--model", demo, "--input", path)
    assert rc == 2 and err.strip() == (f"error: no speech detected in {path} (the webrtcvad speech detector heard "
                                       f"none); record it louder or closer to the microphone, or pass --no-vad to "
                                       f"use the file as it is")


# ---------------------------------------------------------------- 1. an input longer than the context

def test_reply_hears_the_newest_part_of_a_long_input_and_says_so(capsys, demo, tmp_path):
    import numpy as np
    import soundfile as sf

    path = tmp_path / "long.wav"
    t = np.arange(200 * 16000) / 16000  # 200 s: more than the demo's 4096-token context holds
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, subtype="PCM_16")
    rc, out, err = _run(capsys, "reply", "--model", demo, "--input", path, "--greedy", "--max-text-tokens", "8",
                        "--max-codec-tokens", "16")
    assert rc == 0, err
    note = next(line for line in out.splitlines() if line.startswith("note:"))
    kept = float(note.split("holds ")[1].split(" s")[0])
    assert 100 < kept < 200 and f"first {200 - kept:.1f} s were not heard" in note
    assert "CacheFullError" not in out + err


# ---------------------------------------------------------------- 2. Ctrl-C keeps the record

def test_ctrl_c_during_talk_writes_the_turns_so_far_and_exits_130(demo, tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    fixtures = Path(__file__).parent / "fixtures"
    out, timeline = tmp_path / "out.wav", tmp_path / "t.json"
    p = subprocess.Popen([sys.executable, "-m", "omnidesk", "talk", "--model", str(demo),
                          "--input", str(fixtures / "question.wav"), "--input", str(fixtures / "second_question.wav"),
                          "--output", str(out), "--timeline", str(timeline)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "end of turn" not in (p.stdout.readline() or ""):
        pass  # the conversation has started (the line before the table)
    time.sleep(5)  # into the first reply, paced in real time
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert "interrupted: the timeline holds" in stderr and "Traceback" not in stderr
    assert out.is_file() and out.stat().st_size > 44 and json.loads(timeline.read_text())["turns"]


def test_talk_says_when_the_utterance_limit_cut_a_turn(capsys, demo, tmp_path):
    import numpy as np
    import soundfile as sf

    path = tmp_path / "long.wav"
    t = np.arange(65 * 16000) / 16000  # one 65 s "utterance": the 30 s limit cuts it twice
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), 16000, subtype="PCM_16")
    rc, out, err = _run(capsys, "talk", "--model", demo, "--input", path, "--output", tmp_path / "o.wav",
                        "--timeline", tmp_path / "t.json", "--fast", "--end-of-turn", "fixed",
                        "--max-text-tokens", "4", "--max-codec-tokens", "8")
    assert rc == 0, err
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 3 and out.index(rows[-1]) < out.index("wrote ")
    assert all("cut at the utterance limit" in r for r in rows[:2]) and "utterance limit" not in rows[2]


# ---------------------------------------------------------------- 7a. the reference model's chatter

@pytest.mark.parametrize("family", ["demo", "qwen3-demo"])
def test_bench_keeps_the_reference_models_chatter_out_of_the_terminal(capfd, family):
    """`omnidesk bench` runs transformers' generate on the same checkpoint as its reference: its load
    report ("MISSING" vision weights), rope-key notes, generation-flag and deprecation warnings and
    progress bars used to fill ~30 lines of stderr.  Only OmniDesk's own lines are left, and the
    reference still ran."""
    import json

    pytest.importorskip("transformers")
    rc = cli.main(["bench", "--model", family, "--compile", "off", "--turns", "1", "--interrupts", "1"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "generate_s" in json.loads(out)["transformers"]
    ours = ("model: ", "demo model at ", "decode steps: ", "NOTE: ")
    others = [line for line in err.splitlines() if line.strip() and not line.startswith(ours)]
    assert not others, "\n".join(others)
