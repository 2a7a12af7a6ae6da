"""Smart Turn v3 end-of-turn classifier (omnidesk/engine/smart_turn.py).

Model tests need the optional extra (onnxruntime + pipecat-ai installed with --no-deps)
and skip without it; the error-message tests run everywhere.  The references are
pipecat's own numpy feature code (loaded from its file: importing the ``pipecat``
package would need loguru and more) and transformers' WhisperFeatureExtractor
configured as Smart Turn's preprocessing (chunk_length=8, 80 mels, do_normalize).
"""

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import wave

import numpy as np
import pytest

from omnidesk.engine import smart_turn
from omnidesk.engine.smart_turn import DISTRIBUTION, MODEL_FILE, SmartTurn, TurnModelUnavailable

SR = 16000
WINDOW = 8 * SR
VOICES = ["en-us", "en-gb", "en-gb-x-rp"]
COMPLETE = "Can you tell me the weather in Paris today?"
CUT = "Can you tell me the weather in"


@pytest.fixture(scope="module")
def turn():
    pytest.importorskip("onnxruntime", reason="optional extra not installed: pip install onnxruntime")
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"optional extra not installed: pip install --no-deps {DISTRIBUTION}")
    return SmartTurn.load()


@pytest.fixture(scope="module")
def pipecat_features(turn):
    """pipecat's ``_whisper_features`` module, loaded from its file (it only needs numpy)."""
    path = importlib.metadata.distribution(DISTRIBUTION).locate_file(
        "pipecat/audio/turn/smart_turn/_whisper_features.py")
    spec = importlib.util.spec_from_file_location("pipecat_whisper_features_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_window(audio: np.ndarray) -> np.ndarray:
    """Smart Turn's input window: the last 8 s, zero-padded at the start."""
    audio = audio[-WINDOW:]
    return np.pad(audio, (WINDOW - len(audio), 0))


def espeak(text: str, voice: str, tmp_path) -> np.ndarray:
    import soxr

    path = tmp_path / f"{voice}-{len(text)}.wav"
    subprocess.run([shutil.which("espeak-ng"), "-v", voice, "-w", str(path), text],
                   check=True, timeout=30, capture_output=True)
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    return soxr.resample(x, rate, SR).astype(np.float32)


def at_pause(speech: np.ndarray, lead: float = 0.5, pause: float = 0.2) -> np.ndarray:
    """Speech as the endpointer would score it: espeak's silence trimmed, 0.5 s before, 200 ms pause after."""
    loud = np.flatnonzero(np.abs(speech) > 1e-3)
    speech = speech[loud[0]:loud[-1] + 1]
    return np.concatenate([np.zeros(int(lead * SR), np.float32), speech, np.zeros(int(pause * SR), np.float32)])


@pytest.fixture(scope="module")
def espeak_pairs(tmp_path_factory):
    """voice -> (complete, cut) utterances at a 200 ms pause, 16 kHz float32."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed (apt-get install espeak-ng)")
    tmp = tmp_path_factory.mktemp("smart-turn-espeak")
    return {v: (at_pause(espeak(COMPLETE, v, tmp)), at_pause(espeak(CUT, v, tmp))) for v in VOICES}


def signals():
    rng = np.random.default_rng(0)
    t = np.arange(11 * SR) / SR
    voiced = (0.3 * np.sin(2 * np.pi * 150 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
              + 0.01 * rng.standard_normal(t.shape)).astype(np.float32)
    # shorter than the window (padded at the start), exactly 8 s, longer (keeps the end), tiny
    return {"1.3s": voiced[:int(1.3 * SR)], "8s": voiced[:WINDOW], "11s": voiced, "0.01s": voiced[:160]}


@pytest.fixture(scope="module")
def transformers_features():
    """transformers' WhisperFeatureExtractor as Smart Turn's preprocessing configures it."""
    transformers = pytest.importorskip("transformers")
    fe = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=8)

    def features(audio):
        return fe(reference_window(audio), sampling_rate=SR, return_tensors="np", padding="max_length",
                  max_length=WINDOW, truncation=True, do_normalize=True).input_features[0]

    return features


@pytest.fixture(scope="module")
def cases(espeak_pairs):
    out = dict(signals())
    out.update({f"{v}-{k}": a for v, pair in espeak_pairs.items() for k, a in zip(("complete", "cut"), pair)})
    return out


def run_model(turn, features):
    return float(turn.session.run(None, {"input_features": features[None]})[0][0, 0])


@pytest.mark.parametrize("name", ["1.3s", "8s", "11s", "0.01s"])
def test_features_match_transformers(turn, transformers_features, name):
    audio = signals()[name]
    ours = turn.features(audio)
    assert ours.shape == (80, 800) and ours.dtype == np.float32
    # both run the same float32 torch STFT and mel projection: equal to the last bit today
    np.testing.assert_allclose(ours, transformers_features(audio), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["1.3s", "8s", "11s", "0.01s"])
def test_features_match_pipecat(turn, pipecat_features, name):
    """pipecat's runtime feature code (what LocalSmartTurnAnalyzerV3 feeds the model)."""
    audio = signals()[name]
    ref = pipecat_features.compute_whisper_log_mel_features(reference_window(audio), do_normalize=True)
    # pipecat computes the spectrogram in float64, we in float32: up to ~1.2e-5 apart, in spectral dips
    np.testing.assert_allclose(turn.features(audio), ref, rtol=0, atol=5e-5)


def test_probability_matches_reference_pipeline(turn, transformers_features, cases):
    # Against transformers' features only: the int8 model is so sensitive that pipecat's float64
    # features (within 1.2e-5 of ours) move the probability by up to ~0.3 on these inputs, and a
    # 1e-6 perturbation of the features moves it by as much.
    for name, audio in cases.items():
        p = turn.score(audio)
        assert 0.0 <= p <= 1.0, (name, p)
        assert abs(p - run_model(turn, transformers_features(audio))) < 1e-5, name


@pytest.mark.xfail(strict=False, reason=(
    "Smart Turn v3.2 does not separate espeak-ng speech: the cut phrase scores ~0.8-0.97 "
    "'complete', above the full question (~0.6-0.75) for these three voices; over 6 voices, "
    "3 rates and 4 sentences it ranks complete above cut about half the time"))
@pytest.mark.parametrize("voice", VOICES)
def test_complete_scores_above_cut_on_espeak(turn, espeak_pairs, voice):
    complete, cut = espeak_pairs[voice]
    assert turn.score(complete) > turn.score(cut)


def test_describe_and_available(turn):
    assert SmartTurn.available()
    text = turn.describe()
    assert "smart-turn-v3.2-cpu.onnx" in text and DISTRIBUTION in text and "onnxruntime" in text


def test_score_rejects_bad_audio(turn):
    with pytest.raises(ValueError, match="1-D"):
        turn.score(np.zeros((2, SR), np.float32))
    with pytest.raises(TypeError, match="float"):
        turn.score(np.zeros(SR, np.int16))


# ---------------------------------------------------------------- errors (no extra needed)


def fake_distribution(root, files: dict[str, bytes], record: str | None = None):
    """A pipecat-ai 9.9 distribution in ``root`` with the given files and RECORD."""
    info = root / "pipecat_ai-9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: 9.9\n")
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (info / "RECORD").write_text(record if record is not None else "".join(f"{rel},,\n" for rel in files))
    return importlib.metadata.PathDistribution(info)


def test_missing_pipecat_names_the_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smart_turn.importlib.metadata, "distribution", missing)
    with pytest.raises(TurnModelUnavailable, match="pip install --no-deps pipecat-ai"):
        smart_turn.bundled_model()
    assert not SmartTurn.available()


def test_missing_onnxruntime_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` raise ImportError
    with pytest.raises(TurnModelUnavailable, match="pip install onnxruntime"):
        SmartTurn.load()


def test_missing_or_damaged_model_file(monkeypatch, tmp_path):
    # pipecat-ai installed, but a version without the file
    dist = fake_distribution(tmp_path / "a", {"pipecat/__init__.py": b""})
    monkeypatch.setattr(smart_turn.importlib.metadata, "distribution", lambda name: dist)
    with pytest.raises(TurnModelUnavailable, match="does not list .*smart-turn-v3.2-cpu.onnx"):
        smart_turn.bundled_model()

    # listed in RECORD, deleted from disk
    dist = fake_distribution(tmp_path / "b", {MODEL_FILE: b"x"})
    os.remove(tmp_path / "b" / MODEL_FILE)
    monkeypatch.setattr(smart_turn.importlib.metadata, "distribution", lambda name: dist)
    with pytest.raises(TurnModelUnavailable, match="missing .*--force-reinstall --no-deps pipecat-ai==9.9"):
        smart_turn.bundled_model()

    # present, but not what the wheel's RECORD says (truncated download, edited file)
    record = f"{MODEL_FILE},sha256=AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA,1\n"
    dist = fake_distribution(tmp_path / "c", {MODEL_FILE: b"not onnx"}, record)
    monkeypatch.setattr(smart_turn.importlib.metadata, "distribution", lambda name: dist)
    with pytest.raises(TurnModelUnavailable, match="damaged .*--force-reinstall --no-deps pipecat-ai==9.9"):
        smart_turn.bundled_model()


def test_the_model_file_is_hashed_once_until_it_changes(monkeypatch, tmp_path):
    """Every live session opens a judge: its 8 MB file was hashed on each open.  Once it matched
    its RECORD it is not hashed again, unless it changed on disk since."""
    import base64
    import hashlib

    data = b"model bytes"
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    dist = fake_distribution(tmp_path / "d", {MODEL_FILE: data}, f"{MODEL_FILE},sha256={digest},{len(data)}\n")
    monkeypatch.setattr(smart_turn.importlib.metadata, "distribution", lambda name: dist)
    hashed = []
    real = smart_turn.hashlib.sha256
    monkeypatch.setattr(smart_turn.hashlib, "sha256", lambda b=b"": hashed.append(len(b)) or real(b))
    for _ in range(3):
        smart_turn.bundled_model()
    assert len(hashed) == 1
    (tmp_path / "d" / MODEL_FILE).write_bytes(b"edited model bytes")  # another size: checked again
    with pytest.raises(TurnModelUnavailable, match="damaged"):
        smart_turn.bundled_model()
    assert len(hashed) == 2


def test_explicit_path_errors(tmp_path):
    pytest.importorskip("onnxruntime", reason="optional extra not installed: pip install onnxruntime")
    with pytest.raises(TurnModelUnavailable, match="not found"):
        SmartTurn.load(tmp_path / "absent.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(TurnModelUnavailable, match="damaged"):
        SmartTurn.load(bad)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_the_judge_scores_on_a_thread_of_lower_priority_and_hands_out_each_verdict_once():
    """The score runs off the caller's thread, at nice +JUDGE_NICE (the speculative reply goes first
    where they share a core), and the caller's own priority is unchanged."""
    import os
    import threading
    import time

    from omnidesk.engine.turn_judge import JUDGE_NICE, SmartTurnJudge

    class Model:  # what the judge reads of a Smart Turn model, and a score that records its thread
        window_samples = 128000
        cfg = type("Cfg", (), {"sampling_rate": 16000})()
        seen = []

        def score(self, audio):
            tid = threading.get_native_id()
            self.seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid), audio.size))
            return 0.9

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    judge = SmartTurnJudge(Model())
    try:
        assert judge.window_s == 8.0 and not judge.pending
        judge.submit(np.zeros(1600, np.float32))
        assert judge.pending
        deadline = time.monotonic() + 30
        while (ready := judge.poll()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ready[0] == 0.9 and ready[1] >= 0.0 and not judge.pending and judge.poll() is None
        (tid, nice, size), = Model.seen
        assert tid != threading.get_native_id() and nice == min(19, mine + JUDGE_NICE) and size == 1600
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    finally:
        judge.close()


def test_without_a_spare_core_a_score_waits_for_the_held_replys_first_chunk(monkeypatch):
    """Where the rest of the machine leaves less than SIDE_BY_SIDE_CORES a score submitted while a
    held reply makes its first chunk starts only once that chunk is made (or SCORE_WAIT_MAX_S has
    passed); with cores to spare, where they cannot be read, or once the chunk exists, at once.
    The reply's side is an Event (ReplyRun.past_first_chunk)."""
    import threading
    import time

    from omnidesk.engine import turn_judge
    from omnidesk.engine.turn_judge import SIDE_BY_SIDE_CORES, SmartTurnJudge

    class Model:
        window_samples = 128000
        cfg = type("Cfg", (), {"sampling_rate": 16000})()

        def __init__(self):
            self.started = threading.Event()

        def score(self, audio):
            self.started.set()
            return 0.9

    class Cores:  # a CoreMeter reading
        def __init__(self, spare):
            self.value = spare

        def spare(self):
            return self.value

    def verdict(judge):
        deadline = time.monotonic() + 30
        while (ready := judge.poll()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return ready

    monkeypatch.setattr(turn_judge, "SCORE_WAIT_MAX_S", 60.0)
    for spare, waits in ((SIDE_BY_SIDE_CORES - 0.6, True), (SIDE_BY_SIDE_CORES + 0.4, False), (None, False)):
        model = Model()
        judge = SmartTurnJudge(model, cores=Cores(spare))
        try:
            first_chunk = threading.Event()
            judge.score_after(first_chunk)
            judge.submit(np.zeros(1600, np.float32))
            if waits:
                assert not model.started.wait(0.3) and judge.pending and judge.poll() is None
                first_chunk.set()
            assert verdict(judge)[0] == 0.9 and model.started.is_set()
            # the chunk is made (or was never waited for): the next score of the pause starts at once
            first_chunk.set()
            model.started.clear()
            judge.submit(np.zeros(1600, np.float32))
            assert verdict(judge)[0] == 0.9 and model.started.is_set()
        finally:
            judge.close()
    # a first chunk that does not come holds a score SCORE_WAIT_MAX_S at most
    monkeypatch.setattr(turn_judge, "SCORE_WAIT_MAX_S", 0.05)
    model = Model()
    judge = SmartTurnJudge(model, cores=Cores(0.0))
    try:
        judge.score_after(threading.Event())
        judge.submit(np.zeros(1600, np.float32))
        assert verdict(judge)[0] == 0.9
    finally:
        judge.close()


def test_the_core_meter_counts_other_processes_on_this_process_cores_only(tmp_path):
    """CoreMeter reads /proc/stat's per-core lines (cores outside this process's affinity and the
    all-cores line are skipped) and takes this process's own CPU time off what they show."""
    import os

    from omnidesk.engine.cpu_priority import CoreMeter

    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    clock, own = [100.0], [5.0]

    def write(busy_per_core, idle_per_core, foreign_busy):
        # user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
        lines = [f"cpu  {9 * tick} 0 0 0 0 0 0 0 0 0"]
        for c in range(os.cpu_count() or 1):
            busy = foreign_busy if c not in meter_cpus else busy_per_core
            lines.append(f"cpu{c} {busy // 2} 0 {busy - busy // 2} {idle_per_core} 3 0 0 0 0 0")
        lines += ["intr 123 4 5", "ctxt 42", "procs_running 3"]
        stat.write_text("\n".join(lines) + "\n")

    meter_cpus = frozenset(os.sched_getaffinity(0))
    write(0, 0, 0)
    meter = CoreMeter(window_s=1.0, stat_path=str(stat), clock=lambda: clock[0], own_cpu=lambda: own[0])
    assert meter.cpus == meter_cpus and meter.spare() is None  # no window yet
    # 2 s later: our cores were busy 1.5 s each; this process used 1 s of that in all
    clock[0] += 2.0
    own[0] += 1.0
    write(int(1.5 * tick), 0, 10**6)
    n = len(meter_cpus)
    others = (1.5 * n - 1.0) / 2.0
    assert meter.spare() == pytest.approx(max(0.0, n - others))
    # a look within the window keeps the last reading
    clock[0] += 0.5
    write(int(3.0 * tick), 0, 10**6)
    assert meter.spare() == pytest.approx(max(0.0, n - others))
    # where /proc/stat cannot be read there is no answer
    assert CoreMeter(stat_path=str(tmp_path / "missing")).spare() is None
