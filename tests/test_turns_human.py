"""End of turn on recorded human speech (../shared/data/turns-human, read in place, never copied).

The files go through what the product runs: WebRTC VAD -> Endpointer (-> Smart Turn, scored
inline as ``talk --fast`` does).  A live microphone's detector has always heard the room's noise
floor before the user speaks, so the detector is warmed on the file's own floor (its first
100 ms) first.  Margins, not exact scores: the checks are on which side of the labelled speech end
a decision falls, and within how long.
"""

from __future__ import annotations

import csv
import json
import wave
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("webrtcvad")

from omnidesk.audio.vad import WebRtcVAD  # noqa: E402
from omnidesk.engine.vad import Endpoint, Endpointer, EndpointerConfig  # noqa: E402

SET_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "turns-human"
SR, FRAME = 16000, 640


@pytest.fixture(scope="module")
def labels() -> dict[str, dict]:
    if not (SET_DIR / "labels.csv").is_file():
        pytest.skip(f"the recorded human turns are not here: {SET_DIR} (see bench/README.md, turn_taking.py --set)")
    with (SET_DIR / "labels.csv").open(newline="") as f:
        return {r["file"]: r for r in csv.DictReader(f)}


def read(name: str) -> np.ndarray:
    with wave.open(str(SET_DIR / name)) as w:
        assert w.getframerate() == SR and w.getnchannels() == 1
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


def endpoints(endpointer: Endpointer, audio: np.ndarray, t0: float = 0.0) -> list[Endpoint]:
    """Push ``audio`` in 40 ms frames from session time ``t0``; the endpoints, resetting after each."""
    out = []
    audio = np.concatenate([audio, np.zeros((-audio.size) % FRAME, np.float32)])
    for i in range(0, audio.size, FRAME):
        for ev in endpointer.push(audio[i:i + FRAME], t0 + i / SR):
            if isinstance(ev, Endpoint):
                out.append(ev)
                endpointer.reset()
    return out


@pytest.mark.parametrize("name", ["turn_a07.wav", "turn_a19.wav", "turn_a13.wav"])
def test_digital_silence_before_a_turn_does_not_stretch_its_endpoint(labels, name):
    """talk plays inputs after digital silence.  webrtcvad shown those zeros settled its noise model at
    zero and called the next noise floor speech: these turns ended 0.9-1.6 s after the speech, not
    ~0.5 s.  Zeros are not shown to it now, and the fixed 400 ms rule ends each one in time."""
    x = read(name)
    ep = Endpointer(WebRtcVAD(), EndpointerConfig(), SR)
    lead = 3.0
    ends = endpoints(ep, np.concatenate([np.zeros(int(lead * SR), np.float32), x]))
    speech_end = lead + float(labels[name]["speech_end_s"])
    assert len(ends) == 1, ends
    assert 0.3 <= ends[0].t_endpoint - speech_end <= 0.7, (ends[0], speech_end)


def test_the_cancellers_residue_under_a_reply_is_not_speech(labels):
    """On the virtual devices the microphone gives digital zeros after a question, and the echo
    canceller turns them into +-1 LSB of residue once the reply plays into its reference.  webrtcvad,
    whose last sound was the question, called some of those frames speech (16 frames over the 15
    finished questions here, 3 in a row live: a false barge-in 0.4 s into every reply, an audible
    pause).  Frames within 2 LSB of zero that follow zeros are digital silence now, like the zeros."""
    from omnidesk.audio.aec import EchoCanceller, EchoCancellerUnavailable

    try:
        EchoCanceller(SR)
    except EchoCancellerUnavailable as e:
        pytest.skip(f"no echo canceller: {e}")
    noise = np.random.default_rng(0)
    speech = 0
    for name in [n for n, row in labels.items() if row["label"] == "complete"]:
        question = read(name)[: int((float(labels[name]["speech_end_s"]) + 0.05) * SR)]
        question = question[: question.size // FRAME * FRAME]
        mic = np.concatenate([question, np.zeros(3 * SR, np.float32)])
        reply = (noise.standard_normal(3 * SR - SR // 2) * 0.15).astype(np.float32)  # the demo's reply: noise
        reference = np.concatenate([np.zeros(question.size + SR // 2, np.float32), reply])
        aec, vad = EchoCanceller(SR), WebRtcVAD()
        heard = [vad.is_speech(aec.process(mic[i:i + FRAME], reference[i:i + FRAME]))
                 for i in range(0, mic.size, FRAME)]
        speech += sum(heard[question.size // FRAME + 5:])  # from 200 ms on: past the canceller's lag
    assert speech == 0


@pytest.fixture(scope="module")
def judge():
    from omnidesk.engine.turn_judge import make_judge

    pytest.importorskip("onnxruntime", reason="optional: pip install onnxruntime")
    j = make_judge("auto", blocking=True)
    if j is None:
        pytest.skip("Smart Turn is not installed (dev/setup.sh installs it)")
    yield j
    j.close()


def conversation(labels, judge) -> dict[str, list[Endpoint]]:
    """Every file of the set in order through ONE detector, as talk plays them (0.6 s of digital
    silence between): each file's endpoints, times from the file's start."""
    vad = WebRtcVAD()
    out = {}
    for name in labels:
        ep = Endpointer(vad, EndpointerConfig(), SR, judge=judge)
        out[name] = endpoints(ep, read(name))
        endpoints(ep, np.zeros(int(0.6 * SR), np.float32))
    return out


def cut_ins(labels, ends: dict[str, list[Endpoint]]) -> tuple[int, int]:
    """(early cut-ins, all cut-ins): a turn ended before the labelled speech end, or inside the
    trailing 1.5 s of a cut-off sentence."""
    early = total = 0
    for name, row in labels.items():
        speech_end = float(row["speech_end_s"])
        is_early = any(e.t_endpoint < speech_end for e in ends[name])
        false = row["label"] == "pause" and any(speech_end <= e.t_endpoint < speech_end + 1.5 for e in ends[name])
        early += is_early
        total += is_early or false
    return early, total


@pytest.fixture(scope="module")
def judged(labels, judge):
    return conversation(labels, judge)


def test_finished_sentences_are_answered_by_the_model_well_before_the_silence_rule(labels, judged):
    complete = [n for n, r in labels.items() if r["label"] == "complete"]
    by_model = []
    for name in complete:
        speech_end = float(labels[name]["speech_end_s"])
        last = judged[name][-1]
        assert last.t_endpoint >= speech_end, (name, judged[name])
        if last.by == "model" and last.t_endpoint - speech_end <= 0.35:
            by_model.append(name)
    # 15 of 15 when this was written; the silence rule needs ~520 ms
    assert len(by_model) >= len(complete) - 3, sorted(set(complete) - set(by_model))


def test_the_model_cuts_in_no_more_than_the_silence_rule(labels, judged):
    """Under the first settings, measured on a detector started cold on each file, the model cut
    in mid-sentence (comma pauses it calls complete) on 13 of the 30 turns and 23 in all, the
    silence rule on 18.  Margins: a few either way."""
    early, total = cut_ins(labels, judged)
    fixed_early, fixed_total = cut_ins(labels, conversation(labels, None))
    assert early <= 6, early
    assert total <= fixed_total + 1, (total, fixed_total)


# ---------------------------------------------------------------- bench/turn_taking.py --set


@pytest.fixture(scope="module")
def bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "turn_taking_bench", Path(__file__).resolve().parents[1] / "bench" / "turn_taking.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_set(folder: Path, labels, names) -> Path:
    """A labelled folder of a few of the set's files (links to them, in a temp dir: nothing copied)."""
    folder.mkdir()
    rows = [labels[n] for n in names]
    with (folder / "labels.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for n in names:
        (folder / n).symlink_to(SET_DIR / n)
    (folder / "README.md").write_text("| file | label | speaker |\n|---|---|---|\n"
                                      + "".join(f"| {n} | {labels[n]['label']} | S{i % 2} |\n" for i, n in enumerate(names)))
    return folder


def test_bench_set_runs_talk_and_scores_each_file(labels, bench, tmp_path, capsys):
    folder = small_set(tmp_path / "set", labels, ["turn_a13.wav", "turn_a29.wav", "turn_a20.wav"])
    out = tmp_path / "tt.json"
    assert bench.main(["--set", str(folder), "--policies", "fixed", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    fixed = result["policies"]["fixed"]
    assert fixed["status"] == "ok" and fixed["detector"] == "silence" and fixed["files"] == 3
    # the silence rule ends the cut-off sentence in its 1.5 s of silence: one false endpoint
    assert (fixed["cut_ins"], fixed["early_cutins"], fixed["false_endpoints"], fixed["missed"]) == (1, 0, 1, 0)
    assert 300 <= fixed["endpoint_ms"]["median"] <= 700 and fixed["cpu_ms_per_score"] is None
    assert set(fixed["per_speaker"]) == {"S0", "S1"}
    assert sum(s["files"] for s in fixed["per_speaker"].values()) == 3
    assert [r["file"] for r in fixed["files_detail"]] == ["turn_a13.wav", "turn_a29.wav", "turn_a20.wav"]


def test_bench_set_names_what_is_wrong_with_a_folder(bench, tmp_path, capsys):
    assert bench.main(["--set", str(tmp_path), "--policies", "fixed"]) == 2
    assert "no labels.csv" in capsys.readouterr().err
    (tmp_path / "labels.csv").write_text("file,label,speech_end_s\nx.wav,maybe,1.0\n")
    assert bench.main(["--set", str(tmp_path), "--policies", "fixed"]) == 2
    assert "line 2: label must be complete or pause" in capsys.readouterr().err
