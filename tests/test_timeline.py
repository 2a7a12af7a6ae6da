import copy
import json

import pytest

from omnidesk.engine.timeline import (
    BARGE_IN_FIELDS,
    EVENT_NAMES,
    TURN_FIELDS,
    BargeIn,
    Timeline,
    TimelineError,
    TurnTimeline,
    validate,
)

CONTRACT_EVENTS = {
    "audio_encoded", "prefill_done", "first_text_token", "first_codec_token",
    "first_audio_chunk", "playback_start", "reply_done",
}
CONTRACT_TURN = {
    "user_speech_start", "user_speech_end", "endpoint", "events", "prompt_token_ids",
    "text_token_ids", "codec_token_ids", "text", "reply_audio_s", "played_audio_s",
    "interrupted", "barge_in",
}
CONTRACT_BARGE_IN = {
    "onset", "confirmed", "playback_stopped", "heard_audio_s", "kept_text_tokens",
    "rolled_back_tokens", "thinker_cache_before", "thinker_cache_after",
}


def session() -> Timeline:
    tl = Timeline(model={"name": "demo", "family": "qwen2_5_omni"}, device="cpu")
    a = tl.new_turn()
    a.user_speech_start, a.user_speech_end, a.endpoint = 0.2, 1.4, 1.8
    a.mark("audio_encoded", 1.81)
    a.mark("prefill_done", 1.83)
    a.mark("first_text_token", 1.85)
    a.prompt_token_ids = [1, 2, 3]
    a.text_token_ids = [7, 8]
    a.codec_token_ids = [100, 101, 102]
    a.text = "Hi."
    a.reply_audio_s = 0.06
    a.extra["preemptive_starts"] = {"used": 1, "discarded": 0}
    b = tl.new_turn()
    b.user_speech_start, b.user_speech_end, b.endpoint = 3.0, 4.0, 4.4
    b.mark("playback_start", 5.0)
    b.played_audio_s = 0.5
    b.interrupt(BargeIn(onset=5.5, confirmed=5.62, playback_stopped=5.63, heard_audio_s=0.5,
                        kept_text_tokens=3, rolled_back_tokens=9, thinker_cache_before=120,
                        thinker_cache_after=111))
    return tl


def test_contract_keys_exact():
    assert set(EVENT_NAMES) == CONTRACT_EVENTS
    assert set(TURN_FIELDS) == CONTRACT_TURN
    assert set(BARGE_IN_FIELDS) == CONTRACT_BARGE_IN
    d = session().to_dict()
    assert set(d) == {"model", "device", "turns"}
    t0, t1 = d["turns"]
    assert set(t0) == CONTRACT_TURN | {"preemptive_starts"}  # extra merged in
    assert set(t0["events"]) == CONTRACT_EVENTS
    assert t0["barge_in"] is None and t0["interrupted"] is False
    assert set(t1["barge_in"]) == CONTRACT_BARGE_IN and t1["interrupted"] is True


def test_mark_once_and_unknown_name():
    turn = TurnTimeline()
    assert turn.mark("first_audio_chunk", 1.0)
    assert not turn.mark("first_audio_chunk", 2.0)
    assert turn.events["first_audio_chunk"] == 1.0
    with pytest.raises(KeyError):
        turn.mark("first_audio", 1.0)
    assert "first_audio" not in turn.events


def test_none_stays_none():
    d = json.loads(session().to_json())
    ev = d["turns"][0]["events"]
    assert ev["first_codec_token"] is None and ev["playback_start"] is None and ev["reply_done"] is None
    assert ev["audio_encoded"] == 1.81
    empty = TurnTimeline().to_dict()
    assert all(v is None for v in empty["events"].values())
    assert empty["user_speech_start"] is None and empty["endpoint"] is None


def test_validate_accepts_good_and_rejects_missing_or_wrong():
    good = json.loads(session().to_json())
    validate(good)
    for path in (("device",), ("turns", 0, "endpoint"), ("turns", 0, "events", "reply_done"),
                 ("turns", 1, "barge_in", "heard_audio_s")):
        bad = copy.deepcopy(good)
        node = bad
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        with pytest.raises(TimelineError, match=repr(path[-1])):
            validate(bad)
    for mutate in (
        lambda d: d["turns"][0].__setitem__("text_token_ids", [1, "2"]),
        lambda d: d["turns"][0].__setitem__("interrupted", 0),
        lambda d: d["turns"][0]["events"].__setitem__("prefill_done", "soon"),
        lambda d: d["turns"][0].__setitem__("barge_in", good["turns"][1]["barge_in"]),  # not interrupted
        lambda d: d["turns"][1].__setitem__("barge_in", None),  # interrupted without details
        lambda d: d["turns"][1]["barge_in"].__setitem__("rolled_back_tokens", 9.0),
        lambda d: d.__setitem__("turns", {}),
    ):
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(TimelineError):
            validate(bad)


def test_json_round_trip(tmp_path):
    tl = session()
    path = tmp_path / "t.json"
    tl.write(path)
    loaded = json.loads(path.read_text())
    validate(loaded)
    assert loaded == tl.to_dict()
    again = Timeline.from_dict(loaded)
    assert again.to_dict() == loaded
    assert again.turns[0].extra == {"preemptive_starts": {"used": 1, "discarded": 0}}


def test_multi_codebook_codec_ids_and_extra_clash():
    tl = Timeline(model={}, device="cpu")
    t = tl.new_turn()
    t.codec_token_ids = [[1, 2, 3], [4, 5, 6]]
    validate(json.loads(tl.to_json()))
    t.extra["text"] = "shadow"
    with pytest.raises(TimelineError):
        tl.to_dict()
    del t.extra["text"]
    t.interrupted = True  # without barge_in: inconsistent
    with pytest.raises(TimelineError):
        tl.to_dict()


def test_nan_time_is_rejected():
    tl = Timeline(model={}, device="cpu")
    tl.new_turn().endpoint = float("nan")
    with pytest.raises(ValueError):
        tl.to_json()
    d = tl.to_dict()
    with pytest.raises(TimelineError):
        validate(d)
