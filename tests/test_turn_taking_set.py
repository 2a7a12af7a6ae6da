"""tests/turn_taking_set.py: the labelled turn-taking set (issue 13) is generated as labelled.

A small subset (the first 2 sentences: 4 items, ~1 s with espeak-ng) in a tmp folder."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import turn_taking_set as tts

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                reason="espeak-ng not installed (apt-get install -y espeak-ng)")

LIMIT = 2


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    directory = tmp_path_factory.mktemp("turn-set")
    return directory, tts.ensure_set(directory, limit=LIMIT)


def read(path):
    import soundfile as sf

    x, rate = sf.read(path, dtype="float32", always_2d=True)
    info = sf.info(path)
    return x, rate, info


def frame_dbfs(x: np.ndarray, frame: int = 320) -> np.ndarray:
    """Level of each 20 ms frame (dBFS)."""
    n = len(x) // frame
    ms = (x[:n * frame].reshape(n, frame).astype(np.float64) ** 2).mean(axis=1)
    return 10 * np.log10(np.maximum(ms, 1e-20))


def test_files_and_labels(made):
    directory, manifest = made
    items = manifest["items"]
    assert len(items) == 2 * LIMIT
    assert [it["kind"] for it in items] == ["complete", "incomplete"] * LIMIT
    assert manifest["sample_rate"] == 16000 and manifest["spec"] == tts.spec_hash()
    on_disk = json.loads((directory / "manifest.json").read_text())
    assert [it["id"] for it in on_disk["items"]] == [it["id"] for it in items]
    assert not any("/" in it["path"] for it in on_disk["items"])  # relative in the folder's manifest
    for it in items:
        x, rate, info = read(it["path"])
        assert rate == 16000 and x.shape[1] == 1 and info.subtype == "FLOAT"
        assert it["duration_s"] == pytest.approx(len(x) / rate)
        assert (it["voice"], it["rate"]) == tts.voice_and_rate(it["sentence"])
        head, rest = tts.SENTENCES[it["sentence"]]
        assert it["text"] == f"{head} {rest}"
        assert np.abs(x).max() == pytest.approx(10 ** (tts.PEAK_DBFS / 20), rel=0.05)
        segments = it["speech"]
        assert 0 < segments[0][0] < segments[-1][1] < it["duration_s"]
        if it["kind"] == "complete":
            assert it["pause"] is None and it["pause_ms"] is None and len(segments) == 1
        else:
            p0, p1 = it["pause"]
            assert len(segments) == 2 and segments[0][1] == pytest.approx(p0) and segments[1][0] == pytest.approx(p1)
            assert 300 <= it["pause_ms"] <= 900 and (p1 - p0) * 1000 == pytest.approx(it["pause_ms"], abs=0.1)
            assert it["cut"] == [head, rest]
    # the same sentence, complete and cut: same voice and rate; the cut one is longer by about its pause
    for a, b in zip(items[::2], items[1::2]):
        assert a["sentence"] == b["sentence"] and (a["voice"], a["rate"]) == (b["voice"], b["rate"])
    assert len({(it["voice"], it["rate"]) for it in items}) == LIMIT  # sentences differ in voice and rate


def test_pauses_are_silent_with_speech_around_them(made):
    _, manifest = made
    for it in manifest["items"]:
        x, rate, _ = read(it["path"])
        x = x[:, 0]
        if it["pause"] is not None:
            a, b = (int(round(t * rate)) for t in it["pause"])
            pause = frame_dbfs(x[a:b])
            assert pause.max() < -70, (it["id"], pause.max())  # quiet ...
            assert pause.min() > -100, it["id"]  # ... but a noise floor, not digital zero
            w = int(0.2 * rate)
            assert frame_dbfs(x[a - w:a]).max() > -35, it["id"]  # the head right before it
            assert frame_dbfs(x[b:b + w]).max() > -35, it["id"]  # the rest right after it
        # the speech segments hold speech; before the first one is digital silence (talk's mic between inputs)
        for s0, s1 in it["speech"]:
            seg = frame_dbfs(x[int(s0 * rate):int(s1 * rate)])
            assert np.median(seg) > -40, it["id"]
        assert not np.any(x[:int(it["speech"][0][0] * rate)])
        # a complete item has no silence long enough for the 400 ms rule (espeak's clause pauses capped)
        if it["kind"] == "complete":
            s0, s1 = it["speech"][0]
            quiet = frame_dbfs(x[int(s0 * rate):int(s1 * rate)]) < -60
            longest = max((len(r) for r in "".join("1" if q else "0" for q in quiet).split("0")), default=0)
            assert longest * 0.02 <= 0.25, (it["id"], longest)


def test_cached_and_deterministic(made, tmp_path):
    directory, manifest = made
    mtime = (directory / "manifest.json").stat().st_mtime_ns
    again = tts.ensure_set(directory, limit=LIMIT)
    assert (directory / "manifest.json").stat().st_mtime_ns == mtime  # reused, not regenerated
    assert again["items"] == manifest["items"]
    other = tts.ensure_set(tmp_path / "other", limit=1)  # same generator, fresh folder: same bytes
    first = manifest["items"][:2]
    for a, b in zip(first, other["items"]):
        assert open(a["path"], "rb").read() == open(b["path"], "rb").read()
        assert {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}
