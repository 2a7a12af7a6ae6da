"""The remote executor against a vLLM-Omni protocol double (tests/vllm_omni_double.py): real sockets,
real SSE parsing, the real engine, paced in real time.

Covered: a full turn (transcript, audio, timeline with its network record, the request the server
gets, the history of the next one); barge-in (the server sees the disconnect within 100 ms of the
cut-in; the next request holds only the heard text, by the local executors' alignment); a voice
barge-in and a discarded preemptive start; a reply still streaming when it is cut or the session
closes (the server sees the disconnect, no reader thread is left, nothing is logged); every error
case (own message naming the server, the turn dropped, the history unchanged, the same turn again
works); a slow server (the network share); a server that sends the audio only at the end (the notice).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import soundfile as sf

from omnidesk.engine.engine import EngineConfig
from omnidesk.engine.speaker import VirtualSpeaker
from omnidesk.engine.talk import FRAME_S, ScriptedEndpointer, Script, run_script
from omnidesk.engine.timeline import Timeline, validate
from omnidesk.engine.duplex import make_engine
from omnidesk.models.alignment import heard_text_pieces
from omnidesk.remote.client import ServerError
from omnidesk.remote.executor import AUDIO_AT_END_NOTICE, CHARS_PER_SECOND
from omnidesk.remote.frontend import connect
from omnidesk.remote.summary import network_summary
from vllm_omni_double import DEFAULT_TEXT, QWEN25, Reply, VllmOmniDouble, slow_reply

FULL_TEXT = "".join(DEFAULT_TEXT)


@pytest.fixture
def double():
    with VllmOmniDouble() as d:
        yield d


def wave(speech_like, seconds: float, seed: int) -> np.ndarray:
    return speech_like(seconds, seed).numpy()


def talk(executor, inputs, no_vad=True, timeline=None, **script):
    """A scripted conversation in real time through the real engine (omnidesk talk's driver)."""
    timeline = timeline or Timeline(model={"family": "remote"}, device="remote")
    engine, speaker = asyncio.run(run_script(executor, Script(list(inputs), no_vad=no_vad, **script),
                                             EngineConfig(voice="Ethan"), timeline, realtime=True))
    return timeline, engine, speaker


def user_audio(message: dict) -> tuple[np.ndarray, int]:
    part = message["content"][0]
    assert part["type"] == "audio_url"
    url = part["audio_url"]["url"]
    assert url.startswith("data:audio/wav;base64,")
    data, rate = sf.read(io.BytesIO(base64.b64decode(url.split(",", 1)[1])), dtype="float32")
    return data, rate


# ---------------------------------------------------------------- a full turn


def test_a_turn_streams_text_and_audio_and_the_next_request_carries_the_history(double, speech_like):
    remote = connect(double.url)
    assert remote.model == double.model and remote.voices == ["Ethan", "Chelsie", "Aiden"]
    assert remote.notice is None  # Qwen3-Omni streams its audio
    first, second = wave(speech_like, 1.0, 1), wave(speech_like, 0.8, 2)
    timeline, engine, speaker = talk(remote.executor, [first, second])
    assert engine.failure is None and len(timeline.turns) == 2
    validate(timeline.to_dict())  # the contract holds, with the network record as an extension

    turn = timeline.turns[0]
    assert turn.text == FULL_TEXT  # every text delta, in order, decoded from the delta ids
    assert len(turn.text_token_ids) == len(DEFAULT_TEXT) and turn.codec_token_ids == []
    assert turn.reply_audio_s == pytest.approx(double.default.audio_s)
    assert turn.played_audio_s == pytest.approx(turn.reply_audio_s)
    ev = turn.events
    assert turn.endpoint <= ev["first_text_token"] <= ev["first_audio_chunk"] <= ev["playback_start"] < ev["reply_done"]
    rec = speaker.recording()
    start = int(round(ev["playback_start"] * 24000))
    assert np.abs(rec[start:start + 24000]).max() > 0.05  # the server's audio reached the speaker

    net = turn.extra["network"]
    assert net["server"] == double.url and net["model"] == double.model and net["error"] is None
    assert net["request_sent"] <= net["first_byte"] <= net["first_text"] <= net["first_audio"] <= net["end"]
    assert 0 <= net["first_byte_ms"] <= net["first_text_ms"] <= net["first_audio_ms"] <= net["end_ms"]
    # the double waits 50 ms before its first chunk and sends the first audio 150 ms later
    assert net["first_text_ms"] >= 50 and net["first_audio_ms"] >= 200
    assert net["aborted"] is None and net["audio_only_at_end"] is False
    assert net["text_deltas"] == len(DEFAULT_TEXT) and net["audio_chunks"] >= 2
    # session times (monotonic stamps mapped through the engine's clock, which runs up to a frame
    # ahead of the wall clock and may lag behind it on a busy machine): the request goes out at the
    # endpoint, the first audio arrives before it is played
    assert turn.endpoint - 0.2 <= net["request_sent"] <= ev["first_text_token"]
    assert net["first_audio"] <= ev["first_audio_chunk"] + 0.05

    r1, r2 = double.requests
    assert r1.completed and r2.completed and r1.disconnected is None
    body = r1.body
    assert body["stream"] is True and body["modalities"] == ["text", "audio"] and body["speaker"] == "Ethan"
    assert body["model"] == double.model
    system, user = body["messages"]
    assert system["role"] == "system" and "Qwen" in system["content"]
    audio, rate = user_audio(user)
    assert rate == 16000 and audio.size == first.size  # the whole utterance, as captured
    assert np.abs(audio - first).max() < 2e-4  # 16-bit PCM
    # turn 2 carries turn 1: its audio and the whole reply text (played to the end)
    messages = r2.body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1] == user and messages[2] == {"role": "assistant", "content": FULL_TEXT}
    assert user_audio(messages[3])[0].size == second.size


def test_audio_at_another_rate_is_resampled_to_the_device_rate(double, speech_like):
    double.default = Reply(sample_rate=16000, audio_s=1.5)
    remote = connect(double.url)
    timeline, engine, _ = talk(remote.executor, [wave(speech_like, 0.8, 3)])
    turn = timeline.turns[0]
    assert engine.failure is None
    assert turn.reply_audio_s == pytest.approx(1.5, abs=0.01)  # 24 kHz samples for 1.5 s sent at 16 kHz


# ---------------------------------------------------------------- barge-in


async def _cut_after(executor, utterance, after_s, close=False):
    """Drive the engine in real time like `talk` (scripted turn boundaries), and cut the reply
    ``after_s`` into its playback the way a confirmed barge-in does (Engine.interrupt), or with
    ``close`` the way LiveSession.close ends a session.  Returns the engine, the timeline and the
    time.monotonic() of the cut-in."""
    rate = executor.sample_rate_in
    frame = int(FRAME_S * rate)
    timeline = Timeline(model={}, device="remote")
    speaker = VirtualSpeaker(sample_rate=24000, block=int(FRAME_S * 24000), capacity_s=4.0)
    endpointer = ScriptedEndpointer(rate)
    engine = make_engine(executor, endpointer, speaker, EngineConfig(), timeline)
    start, n = time.monotonic(), 0
    t_cut = None

    async def tick(samples):
        nonlocal n
        speaker.tick()
        await engine.on_frame(samples, n / rate)
        n += samples.size
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    silence = np.zeros(frame, np.float32)
    try:
        endpointer.begin()
        padded = np.concatenate([utterance, np.zeros((-utterance.size) % frame, np.float32)])
        for i in range(0, padded.size, frame):
            await tick(padded[i:i + frame])
        endpointer.end()
        await tick(silence)
        for _ in range(int(20 / FRAME_S)):
            played = timeline.turns[0].events["playback_start"]
            if played is not None and engine.now >= played + after_s:
                t_cut = time.monotonic()
                if close:  # LiveSession.close: the reply task cancelled, the worker stopped, then the executor told
                    await engine.aclose()
                    engine.close()
                    executor.end_session()
                    return engine, timeline, t_cut
                await engine.interrupt(onset=engine.now, confirmed=engine.now)
                break
            await tick(silence)
        for _ in range(int(0.5 / FRAME_S)):
            await tick(silence)
    finally:
        await engine.aclose()
        engine.close()
    return engine, timeline, t_cut


def test_barge_in_closes_the_stream_at_once_and_keeps_only_the_heard_text(double, speech_like):
    # a long reply, made a little faster than real time: the stream is still open when the user cuts in
    double.default = Reply(audio_s=6.0, pace=1.5)
    remote = connect(double.url)
    ex = remote.executor
    engine, timeline, t_cut = asyncio.run(_cut_after(ex, wave(speech_like, 1.0, 4), 1.0))
    assert t_cut is not None and engine.failure is None
    turn = timeline.turns[0]
    assert turn.interrupted
    req = double.requests[0]
    assert req.disconnected is not None and not req.completed
    latency = req.disconnected - t_cut  # both on time.monotonic(): the server's view of the cut-in
    print(f"server saw the disconnect {latency * 1000:.1f} ms after the cut-in")
    assert 0 <= latency < 0.1
    net = turn.extra["network"]
    assert net["aborted"] is not None and net["aborted_ms"] >= net["first_audio_ms"]

    b = turn.barge_in
    assert b.heard_audio_s == pytest.approx(1.0, abs=0.045)
    # the same alignment as the local executors, over the text deltas: the speech is not finished,
    # so its length is the larger of the audio received and the text at the speaking rate
    expected = heard_text_pieces([len(t) for t in DEFAULT_TEXT], round(b.heard_audio_s * 24000),
                                 round(net["audio_s"] * 24000), False, CHARS_PER_SECOND, 24000)
    assert b.kept_text_tokens == expected and 0 < expected < len(DEFAULT_TEXT)
    assert b.rolled_back_tokens == len(turn.text_token_ids) - expected
    heard = "".join(DEFAULT_TEXT[:expected])
    assert ex.decode(turn.text_token_ids[:b.kept_text_tokens]) == heard
    assert ex.history[-1] == {"role": "assistant", "content": heard}

    # the next turn's request holds only what the user heard
    double.default = Reply()
    timeline2, engine2, _ = talk(ex, [wave(speech_like, 0.7, 5)])
    assert engine2.failure is None
    messages = double.requests[1].body["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == heard and FULL_TEXT.startswith(heard) and heard != FULL_TEXT


def _reader_threads() -> set:
    return {t for t in threading.enumerate() if t.name == "omnidesk-remote-stream"}


def _stop_mid_reply(double, executor, speech_like, caplog, monkeypatch, close: bool):
    """A reply that streams for half a minute, stopped 0.5 s into its playback (a cut-in, or the
    session closing): the server sees the disconnect, no reader thread of the client is left, and
    nothing is logged or raised on a thread.  Returns the timeline and the reader threads still
    alive when the stop returned."""
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    caplog.set_level(logging.WARNING)
    before = _reader_threads()
    double.default = slow_reply()
    engine, timeline, t_cut = asyncio.run(_cut_after(executor, wave(speech_like, 0.8, 15), 0.5, close=close))
    at_once = [t for t in _reader_threads() - before if t.is_alive()]
    assert t_cut is not None and engine.failure is None
    req = double.requests[0]
    # a generous bound: without the abort the double streams on for 30 s
    assert req.wait_disconnected(5.0), "the server never saw the client hang up"
    assert not req.completed
    print(f"server saw the disconnect {(req.disconnected - t_cut) * 1000:.1f} ms after the stop")
    for thread in _reader_threads() - before:
        thread.join(5.0)  # the aborted socket wakes the reader at once
    assert not [t for t in _reader_threads() - before if t.is_alive()], "a reader thread is still running"
    assert not raised and not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    return timeline, at_once


def test_a_cut_in_leaves_no_reader_behind(double, speech_like, caplog, monkeypatch):
    ex = connect(double.url).executor
    timeline, _ = _stop_mid_reply(double, ex, speech_like, caplog, monkeypatch, close=False)
    assert timeline.turns[0].interrupted


def test_closing_the_session_mid_reply_closes_its_stream_and_the_next_session_goes_on(double, speech_like,
                                                                                      caplog, monkeypatch):
    # the engine's aclose cancels the reply without a call to the executor: only end_session (which
    # LiveSession.close calls) stops the stream, and it waits for the reader: none is left at all
    ex = connect(double.url).executor
    _, at_once = _stop_mid_reply(double, ex, speech_like, caplog, monkeypatch, close=True)
    assert at_once == []
    assert ex.history == []  # the unfinished turn is forgotten
    # a session restarted on the same executor (LiveSession.restart) goes on from there
    double.default = Reply(audio_s=0.8)
    timeline, engine, _ = talk(ex, [wave(speech_like, 0.7, 16)])
    assert engine.failure is None and timeline.turns[0].text == FULL_TEXT
    assert [m["role"] for m in double.requests[-1].body["messages"]] == ["system", "user"]


def test_closing_the_session_mid_reply_over_tls_is_as_quiet(certs, speech_like, caplog, monkeypatch):
    cert, key = certs["trusted"]
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    with VllmOmniDouble(certfile=cert, keyfile=key) as double:
        ex = connect(double.url).executor
        _stop_mid_reply(double, ex, speech_like, caplog, monkeypatch, close=True)


def test_a_voice_barge_in_aborts_the_request_and_the_reply_goes_on_from_the_heard_text(double, speech_like):
    double.default = Reply(audio_s=5.0, pace=1.5)
    ex = connect(double.url).executor
    question, cut = wave(speech_like, 1.2, 6), wave(speech_like, 0.9, 7)
    timeline, engine, _ = talk(ex, [question], no_vad=False, barge_in=(1.0, cut))
    assert engine.failure is None and len(timeline.turns) == 2
    first = timeline.turns[0]
    assert first.interrupted and first.barge_in.onset <= first.barge_in.confirmed
    assert double.requests[0].disconnected is not None and not double.requests[0].completed
    # the stream was closed while the engine handled the frame that confirmed the speech (session clock)
    aborted = first.extra["network"]["aborted"]
    assert first.barge_in.confirmed <= aborted + 0.01 and aborted - first.barge_in.confirmed < FRAME_S + 0.1
    # the cut-in became turn 2: its request carries turn 1 cut to what was heard
    messages = double.requests[1].body["messages"]
    heard = messages[2]["content"]
    assert messages[2]["role"] == "assistant" and FULL_TEXT.startswith(heard) and len(heard) < len(FULL_TEXT)
    assert heard == ex.decode(first.text_token_ids[:first.barge_in.kept_text_tokens])


def test_a_discarded_preemptive_start_aborts_its_request(double, speech_like):
    # the user pauses (a preemptive request goes out), then goes on: that request is aborted and
    # the whole utterance is sent again at the endpoint
    double.default = Reply(first_delay_s=0.3)
    ex = connect(double.url).executor
    a, b = wave(speech_like, 0.9, 8), wave(speech_like, 0.8, 9)
    gap = np.zeros(int(0.24 * 16000), np.float32)
    timeline, engine, _ = talk(ex, [np.concatenate([a, gap, b])], no_vad=False)
    assert engine.failure is None and len(timeline.turns) == 1
    turn = timeline.turns[0]
    assert turn.extra.get("preemptive_discarded", 0) >= 1
    assert double.requests[0].disconnected is not None and not double.requests[0].completed
    last = double.requests[-1]
    assert last.completed and len(last.body["messages"]) == 2  # one user turn: nothing of the discarded start
    assert user_audio(last.body["messages"][1])[0].size > a.size + gap.size
    assert ex.history[-1] == {"role": "assistant", "content": FULL_TEXT}


# ---------------------------------------------------------------- failures: own message, history kept, retry works


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Two self-signed certificates for 127.0.0.1 (openssl): one the client trusts, one it does not."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    root = tmp_path_factory.mktemp("certs")
    out = {}
    for name in ("trusted", "stranger"):
        cert, key = root / f"{name}.pem", root / f"{name}.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "2", "-subj", f"/CN=omnidesk-test-{name}",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        out[name] = (str(cert), str(key))
    return out


def _fail_then_retry(double, executor, speech_like, breaks, fixes=lambda: None):
    """Turn 1 works; turn 2 fails (``breaks`` set the server up for it); the same turn again works
    after ``fixes``.  Returns (the failure, the failed turn's request or None, the retry's request)."""
    double.default = Reply(audio_s=0.8)  # short replies: three turns per case
    t1, e1, _ = talk(executor, [wave(speech_like, 0.6, 10)])
    assert e1.failure is None
    history = [dict(m) for m in executor.history]
    assert len(history) == 2
    seen = len(double.requests)
    breaks()
    second = wave(speech_like, 0.6, 11)
    t2, e2, _ = talk(executor, [second])
    failure = e2.failure
    assert failure is not None and failure.stage == "server" and failure.conversation_kept
    error = t2.turns[0].extra["error"]
    assert error["stage"] == "server" and error["conversation_kept"] is True
    assert executor.history == history  # the failed turn left nothing behind
    assert t2.turns[0].extra["network"]["error"] is not None
    failed = double.requests[seen] if len(double.requests) > seen else None
    fixes()
    t3, e3, _ = talk(executor, [second])
    assert e3.failure is None and t3.turns[0].text == FULL_TEXT
    retry = double.requests[-1]
    assert retry.completed
    messages = retry.body["messages"]
    assert messages[1:3] == history and len(messages) == 4
    if failed is not None:
        assert failed.body["messages"] == messages  # the same turn, sent again as it was
    assert len(executor.history) == 4
    return failure, failed, retry


def _fail_with_reply(double, speech_like, reply: Reply):
    """:func:`_fail_then_retry` on a new connection, turn 2 answered with ``reply`` (the retry with the default)."""
    ex = connect(double.url).executor
    return _fail_then_retry(double, ex, speech_like, lambda: double.replies.append(reply))


def test_a_server_error_before_the_stream_has_its_own_message(double, speech_like):
    failure, failed, _ = _fail_with_reply(double, speech_like, Reply(
        status=500, message="CUDA error: an illegal memory access was encountered"))
    assert f"the server at {double.url} answered 500 before the reply: CUDA error" in failure.message


def test_a_client_error_before_the_stream_has_its_own_message(double, speech_like):
    failure, _, _ = _fail_with_reply(double, speech_like, Reply(
        status=400, message="Invalid speaker 'Ethan'. Supported: aiden, chelsie"))
    assert f"{double.url} answered 400 before the reply: Invalid speaker 'Ethan'" in failure.message


def test_an_error_during_the_stream_has_its_own_message(double, speech_like):
    failure, failed, _ = _fail_with_reply(double, speech_like, Reply(fail_after=6, fail_with="error",
                                                                     message="talker stage died"))
    assert f"the server at {double.url} failed during the reply (500): talker stage died" in failure.message
    assert failed.chunks >= 6  # the error came mid-stream, after text had been shown


def test_a_malformed_chunk_has_its_own_message(double, speech_like):
    failure, failed, _ = _fail_with_reply(double, speech_like, Reply(fail_after=4, fail_with="malformed"))
    assert f"the server at {double.url} sent a chunk this client cannot read: not JSON" in failure.message
    assert failed.disconnected is not None  # the client hung up on it


def test_an_audio_chunk_that_is_not_a_sound_file_has_its_own_message(double, speech_like):
    failure, _, _ = _fail_with_reply(double, speech_like, Reply(fail_after=4, fail_with="bad_audio"))
    assert f"the server at {double.url} sent an audio chunk this client cannot read" in failure.message


def test_a_stalled_stream_times_out_with_its_own_message(double, speech_like):
    ex = connect(double.url, read_timeout_s=0.6).executor
    t0 = time.monotonic()
    failure, failed, _ = _fail_then_retry(double, ex, speech_like, lambda: double.replies.append(
        Reply(fail_after=5, fail_with="stall")))
    assert f"the server at {double.url} sent nothing for 0.6 s in the middle of the reply" in failure.message
    assert "read timeout" in failure.message
    assert failed.disconnected is not None  # the client gave up and closed the connection
    assert time.monotonic() - t0 < 30  # not the double's 30 s stall


def test_a_connection_dropped_mid_stream_has_its_own_message(double, speech_like):
    failure, _, _ = _fail_with_reply(double, speech_like, Reply(fail_after=5, fail_with="drop"))
    assert f"the server at {double.url} closed the connection in the middle of the reply" in failure.message


def test_an_unreachable_server_has_its_own_message(double, speech_like):
    ex = connect(double.url).executor
    failure, failed, _ = _fail_then_retry(double, ex, speech_like, double.down, double.up)
    assert failed is None
    assert f"cannot reach the server at {double.url}" in failure.message and "refused" in failure.message


def test_a_refused_api_key_has_its_own_message(speech_like):
    with VllmOmniDouble(api_key="right") as double:
        ex = connect(double.url, api_key="right").executor

        def rotate():
            double.api_key = "rotated"

        def restore():
            double.api_key = "right"

        failure, failed, _ = _fail_then_retry(double, ex, speech_like, rotate, restore)
        assert failed is None  # refused before the handler
        assert f"the server at {double.url} answered 401 (Unauthorized): the API key was refused" in failure.message
        with pytest.raises(ServerError) as e:
            connect(double.url, api_key=None)
        assert e.value.kind == "unauthorized" and "wants an API key and none was given" in str(e.value)
        assert "OMNIDESK_API_KEY" in str(e.value)


def test_an_unknown_model_has_its_own_message(double, speech_like):
    ex = connect(double.url).executor

    def swap():
        double.model = "Qwen/Qwen2.5-Omni-3B"  # the server was restarted with another model

    def back():
        double.model = ex.model

    failure, _, _ = _fail_then_retry(double, ex, speech_like, swap, back)
    assert (f"the server at {double.url} does not serve the model 'Qwen/Qwen3-Omni-30B-A3B-Instruct' "
            f"(The model `Qwen/Qwen3-Omni-30B-A3B-Instruct` does not exist.)") in failure.message


def test_a_tls_failure_has_its_own_message(certs, speech_like, monkeypatch):
    cert, key = certs["trusted"]
    monkeypatch.setenv("SSL_CERT_FILE", cert)  # the client trusts this one certificate (TLS verification on)
    with VllmOmniDouble(certfile=cert, keyfile=key) as double:
        assert double.url.startswith("https://")
        ex = connect(double.url).executor

        def stranger():  # the server comes back with a certificate nobody signed for this client
            double.down()
            double.up(*certs["stranger"])

        def trusted():
            double.down()
            double.up(cert, key)

        failure, failed, _ = _fail_then_retry(double, ex, speech_like, stranger, trusted)
        assert failed is None
        assert f"TLS failure talking to the server at {double.url}" in failure.message
        assert "certificate verify failed" in failure.message or "self-signed" in failure.message
        assert "SSL_CERT_FILE" in failure.message


def test_connecting_says_what_is_wrong(certs, monkeypatch):
    with VllmOmniDouble() as double:
        url = double.url
    with pytest.raises(ServerError) as e:  # nothing listens there any more
        connect(url, connect_timeout_s=2)
    assert e.value.kind == "unreachable" and f"cannot reach the server at {url}" in str(e.value)
    with pytest.raises(ServerError) as e:
        connect("127.0.0.1:8091")
    assert e.value.kind == "url" and "http://HOST:PORT" in str(e.value)
    cert, key = certs["stranger"]
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with VllmOmniDouble(certfile=cert, keyfile=key) as double:
        with pytest.raises(ServerError) as e:
            connect(double.url)
        assert e.value.kind == "tls" and "certificate verify failed" in str(e.value)
        with pytest.raises(ServerError) as e:  # https spoken to as plain http
            connect(double.url.replace("https://", "http://"))
        assert e.value.kind in ("dropped", "http")


# ---------------------------------------------------------------- a slow server, audio only at the end


def test_a_slow_server_shows_its_share_of_the_latency(double, speech_like):
    double.default = Reply(first_delay_s=1.2)
    ex = connect(double.url).executor
    timeline, engine, _ = talk(ex, [wave(speech_like, 0.8, 12)])
    turn = timeline.turns[0]
    net = turn.extra["network"]
    assert net["first_byte_ms"] < 500  # the server answered at once, then took its time
    assert net["first_text_ms"] >= 1200 and net["first_audio_ms"] >= 1350
    v2v = turn.events["playback_start"] - turn.user_speech_end
    assert v2v >= 1.35
    line = network_summary(net, v2v)
    share = net["first_audio_ms"] / (v2v * 1000)
    assert share > 0.6 and f"({share * 100:.0f}% of the voice-to-voice time)" in line


def test_a_server_that_sends_the_audio_only_at_the_end_is_said_so(speech_like):
    with VllmOmniDouble(model=QWEN25) as double:
        double.default = Reply(streaming=False, audio_s=3.0, end_audio_delay_s=0.4)
        remote = connect(double.url)
        # known from the model name: Qwen2.5-Omni's deploy config has no async_chunk
        assert remote.executor.audio_at_end is True and AUDIO_AT_END_NOTICE in remote.notice
        assert remote.voices == ["Chelsie", "Ethan"]
        timeline, engine, _ = talk(remote.executor, [wave(speech_like, 0.8, 13)])
        turn = timeline.turns[0]
        net = turn.extra["network"]
        assert net["audio_only_at_end"] is True and net["audio_chunks"] == 1
        assert turn.events["first_audio_chunk"] > turn.events["first_text_token"] + 0.3  # all the text first
        assert turn.reply_audio_s == pytest.approx(3.0)
        assert "the audio came only when the reply was complete" in network_summary(net)


def test_audio_only_at_the_end_is_noticed_from_a_reply_when_the_name_does_not_say(speech_like):
    with VllmOmniDouble(model="my-omni-model") as double:
        double.default = Reply(streaming=False, audio_s=3.0)
        ex = connect(double.url).executor
        assert ex.audio_at_end is None and ex.notice is None
        talk(ex, [wave(speech_like, 0.8, 14)])
        assert ex.audio_at_end is True and ex.notice.startswith(AUDIO_AT_END_NOTICE)
