"""bench/turn_taking.py (issue 13): one real ``omnidesk talk --end-of-turn fixed`` run over a tiny
subset of the labelled set, checking the JSON's fields and that the counts add up; and the
turn -> item mapping on a hand-made timeline.  No timing thresholds."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "turn_taking.py"
STATS = ("n", "median_ms", "p90_ms", "mean_ms", "min_ms", "max_ms")

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                reason="espeak-ng not installed (apt-get install -y espeak-ng)")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("turn_taking_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def items(bench, tmp_path_factory):
    return bench.turn_taking_set.ensure_set(tmp_path_factory.mktemp("turn-set"), limit=1)["items"]


def _turn(start, end, endpoint, playback, interrupted=False, scores=()):
    events = dict.fromkeys(("audio_encoded", "prefill_done", "first_text_token", "first_codec_token",
                            "first_audio_chunk", "playback_start", "reply_done"))
    events["playback_start"] = playback
    return {"user_speech_start": start, "user_speech_end": end, "endpoint": endpoint, "events": events,
            "interrupted": interrupted,
            "end_of_turn": {"detector": "smart-turn-v3", "ended_by": "model", "scores": list(scores)}}


def test_mapping_and_counts_on_a_made_timeline(bench, items):
    complete, incomplete = items
    lead = bench.map_turns(items, [])[2]["lead_s"]
    a = lead  # the first input starts after talk's lead-in
    on = 0.08  # the frame holding the 0.1 s speech onset
    end_a = a + complete["speech"][0][1] + 0.06
    # the second input starts after the reply (2 s) and GAP_S, on the frame grid
    b = round((end_a + 0.2 + 2.0 + bench.GAP_S) / bench.FRAME_S) * bench.FRAME_S
    p0, p1 = (b + t for t in incomplete["pause"])
    end_b = b + incomplete["speech"][1][1] + 0.06
    turns = [
        _turn(a + on, end_a, end_a + 0.2, end_a + 0.2,
              scores=[{"t": end_a + 0.2, "silence_ms": 160, "p_complete": 0.9, "decision": "complete", "cpu_ms": 20}]),
        # a false endpoint in the pause (the reply starts there; the rest of the sentence cuts it off)
        _turn(b + on, p0 + 0.08, p0 + 0.28, p0 + 0.28, interrupted=True,
              scores=[{"t": p0 + 0.28, "silence_ms": 160, "p_complete": 0.8, "decision": "complete", "cpu_ms": 30}]),
        _turn(p1, end_b, end_b + 0.4, end_b + 0.4),
    ]
    groups, starts, mapping = bench.map_turns(items, turns)
    assert groups == [[0], [1, 2]] and mapping["problems"] == [] and mapping["first_item_offset_ms"] == 0.0
    assert starts[1] == pytest.approx(b)
    r = bench.analyse(items, {"turns": turns})
    assert r["checks"] == {"every_item_mapped": True, "turns_accounted": True, "items_add_up": True}
    assert r["incomplete"]["false_endpoints"] == r["incomplete"]["false_endpoints_in_pause"] == 1
    assert r["incomplete"]["replies_started_in_pause"] == 1 and r["incomplete"]["items_cut"] == 1
    assert r["complete"]["voice_to_voice"]["median_ms"] == pytest.approx(200.0)
    assert r["incomplete"]["final_voice_to_voice"]["median_ms"] == pytest.approx(400.0)
    assert r["complete"]["split_turns"] == 0 and r["interrupted_turns"] == 1
    assert r["scores"]["cpu_ms"]["n"] == 2 and r["scores"]["decisions"] == {"complete": 2}
    assert r["scores"]["first_p_complete_in_pause"] == [0.8]
    assert r["scores"]["first_p_complete_after_complete"] == [0.9]
    # a lost turn shows up as a mapping problem, not as a silently shifted item
    _, _, broken = bench.map_turns(items, turns[1:])
    assert broken["problems"]


def test_smart_is_skipped_with_its_reason_when_unavailable(bench, items, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "smart_unavailable", lambda: "onnxruntime is not installed: pip install onnxruntime")
    monkeypatch.setattr(bench, "run_talk", lambda *a, **k: pytest.fail("talk must not run for a skipped policy"))
    r = bench.bench_policy("smart", items, tmp_path, None)
    assert r == {"status": "skipped", "reason": "onnxruntime is not installed: pip install onnxruntime"}


def test_fixed_policy_through_talk(bench, items, tmp_path):
    out = tmp_path / "turn_taking.json"
    set_dir = Path(items[0]["path"]).parent
    assert bench.main(["--policies", "fixed", "--limit", "1", "--dir", str(set_dir), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["set"]["items"] == 2 and r["set"]["complete"] == r["set"]["incomplete"] == 1
    assert list(r["policies"]) == ["fixed"] and "comparison" not in r
    p = r["policies"]["fixed"]
    assert p["status"] == "ok", p
    assert p["detector"] in ("fixed", None)  # the timeline may leave end_of_turn out for the fixed rule
    assert p["checks"] == {"every_item_mapped": True, "turns_accounted": True, "items_add_up": True}
    assert p["mapping"]["problems"] == [] and p["mapping"]["first_item_offset_ms"] == 0.0
    assert sum(len(row["turns"]) for row in p["items"]) == p["turns"]
    assert [row["id"] for row in p["items"]] == [it["id"] for it in items]
    for key in ("voice_to_voice", "label_end_to_playback", "end_to_endpoint", "endpoint_to_playback"):
        assert set(p["complete"][key]) == set(STATS)
    assert p["complete"]["voice_to_voice"]["n"] + len([i for i in p["missing_latency"] if "-complete" in i]) == 1
    inc = p["incomplete"]
    assert inc["items"] == 1 and 0 <= inc["items_cut"] <= inc["false_endpoints"]
    assert inc["false_endpoints_in_pause"] <= inc["false_endpoints"]
    assert inc["replies_started_in_pause"] <= inc["replies_started_before_done"]
    # every turn of the cut item but its last ended early; the fixed rule scores nothing
    row = p["items"][1]
    assert row["false_endpoints"] == len(row["turns"]) - 1 == inc["false_endpoints"]
    assert p["scores"]["n"] == 0 and p["scores"]["cpu_ms"]["n"] == 0
