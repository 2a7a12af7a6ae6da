"""The `omnidesk` command as a user meets it: clean home directories, a downloaded model, bad inputs.

Most tests call ``omnidesk.cli.main`` in-process (one demo model, loaded once per module, stands in
for every load); the default-model and device cases also run as a subprocess with a clean HOME and
a Hugging Face cache holding a tiny real-layout checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from omnidesk import cli
from omnidesk.models import choice as choice_mod
from omnidesk.models.choice import DEMO, DeviceError, check_device, choose_model, default_device
from omnidesk.models.qwen2_5_omni.demo import default_demo_dir, make_demo

FIXTURES = Path(__file__).parent / "fixtures"
QUESTION = FIXTURES / "question.wav"  # 16 kHz mono synthetic speech (webrtcvad hears it)
REPO = "Qwen/Qwen2.5-Omni-7B"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CPU_ONLY_TORCH = not torch.version.cuda and not getattr(torch.version, "hip", None)
NO_CUDA_BUILD = ("error: --device cuda: this torch build has no CUDA support (CPU-only); "
                 "install a CUDA build of torch or use --device cpu")
FAST_REPLY = ["--max-text-tokens", "2", "--max-codec-tokens", "4"]


# ---------------------------------------------------------------- fixtures

def _clean_env(root: Path) -> dict[str, str]:
    return {"HOME": str(root / "home"), "XDG_CACHE_HOME": str(root / "cache"),
            "XDG_CONFIG_HOME": str(root / "config"), "XDG_STATE_HOME": str(root / "state"),
            "HF_HOME": str(root / "hf")}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A clean home: nothing cached, nothing remembered, logs in tmp."""
    for name, value in _clean_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "OMNIDESK_LOG_DIR", cli.DEBUG_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("omnidesk.cli.model_setup._remembered_model", lambda: None)  # never the developer's QSettings
    return tmp_path


@pytest.fixture(scope="module")
def demo_src(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo") / "demo")


@pytest.fixture
def demo(demo_src):
    """The demo model, made, where `make_demo()` and 'demo' find it in this clean home."""
    target = default_demo_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(demo_src, target_is_directory=True)
    return target


@pytest.fixture(scope="module")
def demo_stack(demo_src):
    from omnidesk.models.qwen2_5_omni.loading import load_stack

    return load_stack(demo_src)


@pytest.fixture
def fast_load(monkeypatch, demo, demo_stack):
    """Loading the demo returns the module's loaded copy; anything else fails loudly."""
    import omnidesk.models.qwen2_5_omni.loading as loading

    loads = []

    def load(model, device="cpu", **kw):
        assert Path(model).resolve() == demo_stack.path.resolve(), model
        loads.append((str(model), device))
        return demo_stack

    monkeypatch.setattr(loading, "load_stack", load)
    return loads


@pytest.fixture
def no_load(monkeypatch):
    """Loading a model is a test failure: the inputs must be refused before."""
    import omnidesk.models.qwen2_5_omni.loading as loading

    def load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_stack", load)


@pytest.fixture(scope="module")
def hf_home(tiny_checkpoints, tmp_path_factory):
    """An HF_HOME whose hub holds a tiny real-layout checkpoint as Qwen/Qwen2.5-Omni-7B."""
    src, _ = tiny_checkpoints("a")
    root = tmp_path_factory.mktemp("hf")
    repo_dir = root / "hub" / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(src, repo_dir / "snapshots" / COMMIT)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return root


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_subprocess(env_root: Path, *argv, hf: Path | None = None, timeout=300) -> subprocess.CompletedProcess:
    env = {**_clean_env(env_root), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if hf is not None:
        env["HF_HOME"] = str(hf)
    return subprocess.run([sys.executable, "-m", "omnidesk", *map(str, argv)], capture_output=True, text=True,
                          env=env, cwd=env_root, timeout=timeout)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def write(path: Path, audio: np.ndarray, rate: int = 16000) -> Path:
    sf.write(str(path), audio, rate)
    return path


# ---------------------------------------------------------------- 1. the default model and device

def test_reply_without_model_uses_the_cached_checkpoint(tmp_path, hf_home):
    # as a user with a downloaded 7B: no --model, no --device, a clean home
    proc = run_subprocess(tmp_path, "reply", "--input", QUESTION, *FAST_REPLY, hf=hf_home)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"model: {REPO} (found in the Hugging Face cache); device: cpu "
                        f"({'this torch build is CPU-only' if CPU_ONLY_TORCH else 'no usable CUDA GPU found'})")
    assert "noise" not in proc.stdout and "heard 2.20 s" in proc.stdout


def test_remembered_choice_comes_before_the_cache_and_the_demo_comes_last(capsys, monkeypatch, home, hf_home,
                                                                         fast_load):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setattr("omnidesk.cli.model_setup._remembered_model", lambda: "demo")
    rc, out, _ = run_cli(capsys, "reply", "--input", QUESTION, *FAST_REPLY)
    assert rc == 0
    assert out.splitlines()[0].startswith("model: demo (remembered from the window's model picker); device: cpu")
    assert "NOTE: Demo model" in out
    # the rule, shared with the window
    assert choose_model(None, remembered="demo").why == choice_mod.WHY_REMEMBERED
    assert choose_model("x/y", remembered="demo").source == "x/y"
    assert choose_model(None).source == REPO
    monkeypatch.setenv("HF_HOME", str(home / "empty-hf"))
    assert choose_model(None) == choice_mod.ModelChoice(DEMO, "Demo model", choice_mod.WHY_NO_REAL)
    rc, out, _ = run_cli(capsys, "--model", "demo", "reply", "--input", QUESTION, *FAST_REPLY)
    assert rc == 0 and out.startswith("model: demo (given with --model); device: cpu")
    assert fast_load == [(str(default_demo_dir()), "cpu")] * 2


def test_remembered_model_is_read_from_the_windows_settings(tmp_path):
    # the file the window writes (QSettings, INI on Linux), read by a fresh process in a clean home
    conf = tmp_path / "config" / "OmniDesk" / "OmniDesk.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("[model]\nsource=Qwen/Qwen2.5-Omni-3B\n")
    env = {**_clean_env(tmp_path), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    code = "from omnidesk.cli import _remembered_model; print(_remembered_model())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.strip() == "Qwen/Qwen2.5-Omni-3B", proc.stderr


def test_default_device_is_cuda_when_usable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda" and choice_mod.why_default_device() == "a CUDA GPU is available"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"


# ---------------------------------------------------------------- 2. devices

@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="the exact message is for a CPU-only torch build")
def test_cuda_on_a_cpu_only_torch_is_one_line_not_a_traceback(tmp_path):
    proc = run_subprocess(tmp_path, "reply", "--device", "cuda", "--input", QUESTION)
    assert proc.returncode == 2 and one_error_line(proc.stderr) == NO_CUDA_BUILD
    proc = run_subprocess(tmp_path, "--device", "gpu", "reply", "--input", QUESTION)
    assert proc.returncode == 2
    assert one_error_line(proc.stderr) == "error: unknown device 'gpu'; use cpu or cuda[:N]"


@pytest.mark.parametrize("device, cuda, gpus, message", [
    ("gpu", None, 0, "error: unknown device 'gpu'; use cpu or cuda[:N]"),
    ("cpu:0", None, 0, "error: unknown device 'cpu:0'; use cpu or cuda[:N]"),
    ("cuda:x", None, 0, "error: unknown device 'cuda:x'; use cpu or cuda[:N]"),
    ("cuda", None, 0, NO_CUDA_BUILD),
    ("cuda", "12.4", 0, "error: --device cuda: no usable CUDA GPU (none found, or its driver is not loaded; "
                        "`nvidia-smi` shows which); use --device cpu"),
    ("cuda:1", "12.4", 1, "error: --device cuda:1: this machine has 1 CUDA GPU(s) (cuda:0); pick one of those"),
])
def test_device_errors(capsys, monkeypatch, no_load, device, cuda, gpus, message):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for argv in (["reply", "--device", device, "--input", QUESTION], ["--device", device, "talk", "--input",
                 QUESTION, "--output", "o.wav", "--timeline", "t.json"]):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and one_error_line(err) == message and out == ""


def test_check_device_accepts_what_the_machine_has(monkeypatch):
    assert check_device("cpu") == "cpu" and check_device(" CPU ") == "cpu"
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda") == "cuda" and check_device("cuda:1") == "cuda:1"


def test_the_window_loader_checks_the_device_too():
    from omnidesk.gui.model_loader import load_model

    with pytest.raises(DeviceError, match="unknown device 'gpu'"):
        load_model(choose_model(DEMO), "gpu", lambda text: None)


# ---------------------------------------------------------------- 3. top-level --model / --device

def test_top_level_options_apply_to_the_command(capsys, no_load, demo):
    rc, out, err = run_cli(capsys, "--model", "demo", "--device", "cpu", "reply", "--input", "missing.wav")
    assert out.splitlines()[0] == "model: demo (given with --model); device: cpu (given with --device)"
    assert rc == 2 and one_error_line(err) == "error: no such file: missing.wav"
    # the same value twice is fine; different values are an error
    rc, out, err = run_cli(capsys, "--model", "demo", "reply", "--model", "demo", "--input", "missing.wav")
    assert rc == 2 and out.startswith("model: demo (given with --model)")
    rc, out, err = run_cli(capsys, "--model", "demo", "talk", "--model", "Qwen/Qwen2.5-Omni-3B", "--input", QUESTION,
                           "--output", "o.wav", "--timeline", "t.json")
    assert rc == 2 and one_error_line(err) == ("error: --model given twice with different values ('demo' before "
                                               "`talk`, 'Qwen/Qwen2.5-Omni-3B' after it); give it once")
    # where they mean nothing they are refused, not ignored
    rc, _, err = run_cli(capsys, "--model", "demo", "doctor")
    assert rc == 2 and one_error_line(err) == "error: --model does not apply to `omnidesk doctor`"
    rc, _, err = run_cli(capsys, "--device", "cpu", "models", "verify", "demo")
    assert rc == 2 and one_error_line(err) == "error: --device does not apply to `omnidesk models verify`"


# ---------------------------------------------------------------- 4. the demo in models list / verify

def test_models_list_and_verify_know_the_demo(capsys, demo_src):
    rc, out, _ = run_cli(capsys, "models", "list")
    assert rc == 0 and out.startswith("no real checkpoint found in the Hugging Face cache")
    rc, out, _ = run_cli(capsys, "models", "verify", "demo")
    assert rc == 1 and "the demo model is not made yet" in out and "omnidesk models make-demo" in out

    target = default_demo_dir()
    target.parent.mkdir(parents=True)
    target.symlink_to(demo_src, target_is_directory=True)  # as `omnidesk models make-demo` leaves it
    rc, out, _ = run_cli(capsys, "models", "list")
    assert rc == 0
    assert out.splitlines()[0] == "demo  (the demo model: random weights, its replies are noise)"
    assert out.splitlines()[1].strip() == str(target) and "no real checkpoint" in out
    for argv in (["models", "verify", "demo"], ["--model", "demo", "models", "verify"],
                 ["models", "verify", "--model", "demo"]):
        rc, out, _ = run_cli(capsys, *argv, "--no-load-test")
        assert rc == 0 and "verified: no problems" in out and "its replies are noise" in out, (argv, out)
    rc, out, _ = run_cli(capsys, "models", "verify", "demo")  # with the load test
    assert rc == 0 and "load test: loaded on the CPU" in out


def test_models_list_shows_real_checkpoints_with_the_demo(capsys, monkeypatch, hf_home, demo):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    rc, out, _ = run_cli(capsys, "models", "list")
    names = [line for line in out.splitlines() if not line.startswith(" ")]
    assert rc == 0 and names == [REPO, "demo  (the demo model: random weights, its replies are noise)"]
    # the window's picker and the automatic choice still leave the demo to its own entry
    from omnidesk.gui.model_loader import catalog

    assert [e.source for e in catalog()] == [REPO, DEMO, "moshi-demo", "qwen3-demo"]


def test_demo_resolves_by_name_but_a_folder_path_still_works(demo, tmp_path, monkeypatch):
    from omnidesk.models.families import resolve_checkpoint

    assert resolve_checkpoint("demo") == demo
    (tmp_path / "demo").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("./demo") == Path("demo")


# ---------------------------------------------------------------- 5. inputs, checked before loading

def test_bad_inputs_are_refused_before_the_model_loads(capsys, tmp_path, demo, no_load):
    (tmp_path / "folder.wav").mkdir()
    (tmp_path / "zero-bytes.wav").write_bytes(b"")
    (tmp_path / "text.wav").write_text("hello")
    write(tmp_path / "no-samples.wav", np.zeros((0, 1), np.float32))
    write(tmp_path / "zeros.wav", np.zeros(16000, np.float32))
    cases = {
        "missing.wav": f"error: no such file: {tmp_path / 'missing.wav'}",
        "folder.wav": f"error: {tmp_path / 'folder.wav'} is a folder, not a sound file",
        "zero-bytes.wav": f"error: {tmp_path / 'zero-bytes.wav'} is empty (0 bytes)",
        "no-samples.wav": f"error: {tmp_path / 'no-samples.wav'} is empty: it holds no audio samples",
        "text.wav": f"error: cannot read {tmp_path / 'text.wav'}: not a sound file this program reads "
                    f"(WAV, FLAC, OGG) (Format not recognised)",
        "zeros.wav": f"error: no speech detected in {tmp_path / 'zeros.wav'}: it is silent (every sample is zero)",
    }
    for name, message in cases.items():
        path = tmp_path / name
        for argv in (["reply", "--input", path], ["talk", "--input", path, "--output", tmp_path / "o.wav",
                                                   "--timeline", tmp_path / "t.json"],
                     ["talk", "--no-vad", "--input", QUESTION, "--input", path, "--output", tmp_path / "o.wav",
                      "--timeline", tmp_path / "t.json"]):
            rc, _, err = run_cli(capsys, "--model", "demo", *argv)
            assert rc == 2 and one_error_line(err) == message, (argv, err)
    rc, _, err = run_cli(capsys, "--model", "demo", "talk", "--input", QUESTION, "--barge-in", "soon:cut.wav",
                         "--output", tmp_path / "o.wav", "--timeline", tmp_path / "t.json")
    assert rc == 2 and one_error_line(err) == ("error: --barge-in wants SECONDS:FILE.wav (e.g. 1.0:cut.wav), "
                                               "got 'soon:cut.wav'")
    rc, _, err = run_cli(capsys, "--model", "demo", "talk", "--input", QUESTION, "--output", tmp_path / "no" / "o.wav",
                         "--timeline", tmp_path / "t.json")
    assert rc == 2 and one_error_line(err) == f"error: --output {tmp_path / 'no' / 'o.wav'}: no such folder: " \
                                              f"{tmp_path / 'no'}"
    assert not (tmp_path / "o.wav").exists() and not (tmp_path / "t.json").exists()


def test_no_speech_is_refused_unless_no_vad(capsys, tmp_path, demo, no_load):
    hiss = write(tmp_path / "hiss.wav", 0.002 * np.random.default_rng(0).standard_normal(16000).astype(np.float32))
    out_args = ["--output", tmp_path / "o.wav", "--timeline", tmp_path / "t.json"]
    expected = (f"error: no speech detected in {hiss} (the webrtcvad speech detector heard none); record it "
                f"louder or closer to the microphone, or pass --no-vad to use the file as it is")
    for argv in (["talk", "--input", hiss, *out_args], ["reply", "--input", hiss]):
        rc, _, err = run_cli(capsys, "--model", "demo", *argv)
        assert rc == 2 and one_error_line(err) == expected
    # --vad energy judges with the energy detector; the message names it
    rc, _, err = run_cli(capsys, "--model", "demo", "talk", "--vad", "energy", "--input", hiss, *out_args)
    assert rc == 2 and "(the energy speech detector heard none)" in err
    # --no-vad: hiss is a turn like any other; the checks pass and the model would load
    for argv in (["talk", "--no-vad", "--input", hiss, *out_args], ["reply", "--no-vad", "--input", hiss]):
        rc, _, err = run_cli(capsys, "--model", "demo", *argv)
        assert rc == 1 and err.startswith("error: loading the model failed: AssertionError"), err


def test_wavs_at_any_rate_and_channel_count_are_resampled(capsys, tmp_path, fast_load):
    speech, rate = sf.read(str(QUESTION), dtype="float32")
    import soxr

    stereo = soxr.resample(speech, rate, 44100)
    path = write(tmp_path / "q44-stereo.wav", np.stack([stereo, 0.5 * stereo], axis=1), 44100)
    audio = cli._read_wav(str(path), 16000)
    assert audio.dtype == np.float32 and audio.ndim == 1 and abs(audio.size - speech.size) <= 2
    assert np.corrcoef(audio[:speech.size], 0.75 * speech[:audio.size])[0, 1] > 0.99  # mixed to mono
    rc, out, err = run_cli(capsys, "reply", "--input", path, *FAST_REPLY)
    assert rc == 0, err
    assert "heard 2.20 s" in out


# ---------------------------------------------------------------- 6. no audio devices

def test_list_devices_with_no_devices_says_so(capsys, monkeypatch):
    import omnidesk.audio.device as device

    monkeypatch.setattr(device, "list_devices", lambda: [])
    rc, out, err = run_cli(capsys, "live", "--list-devices")
    assert rc == 2 and out == ""
    line = one_error_line(err)
    assert line.startswith("error: no audio devices found") and "PulseAudio" in line and "omnidesk doctor" in line


# ---------------------------------------------------------------- 7. download says its size once

def test_download_prints_its_size_estimate_once(capsys, monkeypatch, tmp_path):
    import omnidesk.models.download as download

    monkeypatch.setattr(download, "download", lambda repo, **kw: tmp_path / "snap")
    rc, out, _ = run_cli(capsys, "models", "download", "Qwen/Qwen2.5-Omni-3B")
    assert rc == 0 and out.count("GB to download") == 1 and out.count("11 GB") == 1
    assert out.splitlines()[0] == ("Qwen/Qwen2.5-Omni-3B: about 11 GB to download; in bf16 it fits a 16 GB "
                                   "NVIDIA GPU")


# ---------------------------------------------------------------- 8. unexpected failures

def test_an_unexpected_failure_is_one_error_line_and_a_log(capsys, monkeypatch, home, fast_load):
    import omnidesk.models.qwen2_5_omni.tools as tools

    def boom(*a, **kw):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(tools, "generate_reply", boom)
    rc, _, err = run_cli(capsys, "--model", "demo", "reply", "--input", QUESTION)
    log = home / "state" / "omnidesk" / "omnidesk.log"
    assert rc == 1 and err.splitlines() == [
        "error: generating the reply failed: RuntimeError: boom",
        f"details: the traceback is in {log}; rerun with OMNIDESK_DEBUG=1 to print it here"]
    text = log.read_text()
    assert "Traceback" in text and "RuntimeError: boom" in text and "reply --input" in text
    monkeypatch.setenv("OMNIDESK_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["--model", "demo", "reply", "--input", str(QUESTION)])


def test_unknown_voice_is_a_user_error(capsys, fast_load):
    rc, _, err = run_cli(capsys, "--model", "demo", "reply", "--voice", "Nobody", "--input", QUESTION)
    assert rc == 2 and one_error_line(err) == "error: unknown voice 'Nobody'; this model has: Chelsie, Ethan"


# ---------------------------------------------------------------- 9. a failed turn

def test_talk_reports_a_failed_turn_after_writing_what_it_has(capsys, monkeypatch, tmp_path, fast_load):
    import omnidesk.engine.talk as talk

    real = talk.run_script

    async def failing(*a, **kw):  # as the engine reports a failed turn: run_script returns, failure is set
        engine, speaker = await real(*a, **kw)
        engine.failure = SimpleNamespace(stage="vocoder", message="injected")
        return engine, speaker

    monkeypatch.setattr(talk, "run_script", failing)
    out_wav, timeline = tmp_path / "o.wav", tmp_path / "t.json"
    rc, out, err = run_cli(capsys, "--model", "demo", "talk", "--input", QUESTION, "--output", out_wav,
                           "--timeline", timeline, "--fast", "--greedy", "--max-text-tokens", "2",
                           "--max-codec-tokens", "30")
    assert rc == 1 and one_error_line(err) == "error: the reply failed in the vocoder: injected"
    assert sf.info(str(out_wav)).frames > 0 and json.loads(timeline.read_text())["turns"]
    assert f"wrote {out_wav}" in out


def test_live_returns_1_after_an_error_and_writes_the_timeline(capsys, monkeypatch, tmp_path, fast_load):
    import omnidesk.audio.session as session_mod

    class FakeSession:
        def __init__(self, executor, settings, config, on_update, timeline):
            self.on_update = on_update
            self.audio = SimpleNamespace(describe=lambda: "fake devices")
            self.hearing = "device 16000 Hz -> model 16000 Hz"
            self.stats = SimpleNamespace(barge_ins=0, false_barge_ins=0)

        def start(self):
            self.on_update("error", "the microphone went away; check the device and press Retry")

        def close(self):
            pass

        def echo_reduction_db(self):
            return None

    monkeypatch.setattr(session_mod, "LiveSession", FakeSession)
    timeline = tmp_path / "t.json"
    rc, out, err = run_cli(capsys, "--model", "demo", "live", "--timeline", timeline, "--duration", "5")
    assert rc == 1 and timeline.is_file()
    assert one_error_line(err) == "error: the microphone went away; check the device and press Retry"


def test_end_of_turn_choice_is_said_and_smart_without_its_packages_is_a_user_error(capsys, monkeypatch, tmp_path,
                                                                                   fast_load):
    import importlib.metadata

    out_wav, timeline = tmp_path / "o.wav", tmp_path / "t.json"
    argv = ("--model", "demo", "talk", "--input", QUESTION, "--output", out_wav, "--timeline", timeline, "--fast",
            "--greedy", "--max-text-tokens", "2", "--max-codec-tokens", "30")
    rc, out, _ = run_cli(capsys, *argv, "--end-of-turn", "fixed")
    assert rc == 0 and "end of turn: silence (400 ms)" in out
    assert json.loads(timeline.read_text())["turns"][0]["end_of_turn"]["detector"] == "fixed"

    def missing(name):  # as on a machine without the optional model file
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    rc, _, err = run_cli(capsys, *argv, "--end-of-turn", "smart")
    assert rc == 2 and "pip install --no-deps pipecat-ai" in one_error_line(err)
    rc, out, _ = run_cli(capsys, *argv)  # auto: the silence rule, and it says why
    assert rc == 0 and "end of turn: silence (400 ms) (the Smart Turn model is not installed)" in out
