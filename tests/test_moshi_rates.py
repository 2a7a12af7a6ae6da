"""Moshi hears 24 kHz audio as it is (issue 26): no 16 kHz stop on the model's path.

Mimi was trained on 24 kHz audio; a 24 -> 16 -> 24 kHz round trip removes everything above 8 kHz
and changes its codes.  Checked here:

* ``omnidesk talk --greedy`` on a 24 kHz file gives, frame for frame, the text tokens of Kyutai's
  ``LMGen`` (the ``moshi`` package, the test oracle) on that file after talk's lead-in silence, and
  the same file round-tripped through 16 kHz gives other tokens: the comparison sees a round trip;
* what the model is handed (``MoshiExecutor.encode_audio``): a 24 kHz file's samples unchanged, a
  16 kHz file's upsampled once, from ``talk`` and from the window's sound-file input alike;
* the live path offline (:class:`~omnidesk.audio.capture.CapturePath`): one resample from the
  device to 24 kHz, through the echo canceller at 48 kHz on speakers, nothing to do from a 24 kHz
  device with headphones; a 10 kHz tone (above a 16 kHz stage's band) comes through;
* live on PulseAudio virtual devices at 24 kHz (float32, headphones): the codes Mimi receives are
  the codes of the played file, delayed by the devices' latency (found by cross-correlation; the
  reference is shifted, not the codes, since Mimi's codes are frame-aligned).

The checkpoint is a tiny random Moshi built with the oracle's own classes (as tests/test_moshi_lm.py
and tests/test_mimi.py do), with one difference that matters here: Mimi's codewords are placed by
the oracle's k-means codebook initialisation on the encoder's latents of speech-like audio
(``EuclideanCodebook._init_embedding``, what Kyutai's training does on its first batch), so that
frames fall among many codewords and a change of the audio changes the codes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch

from omnidesk import cli
from omnidesk.audio.capture import CapturePath, Decimator
from omnidesk.engine.duplex import VAD_RATE, session_rate, vad_rate
from omnidesk.engine.talk import FRAME_S, LEAD_SILENCE_S
from omnidesk.models.moshi.config import MOSHI_NAME, TOKENIZER_NAME, MoshiConfig
from omnidesk.models.moshi.executor import MoshiExecutor, load_moshi
from omnidesk.models.moshi.mimi import DEMO as MIMI_DEMO
from omnidesk.models.moshi.mimi import MIMI_NAME
from omnidesk.models.moshi.tokenizer import write_demo_tokenizer

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # the oracle would torch.compile its RoPE otherwise
pytest.importorskip("moshi", reason="the moshi package (test oracle) is not installed")
from moshi.models.lm import LMGen  # noqa: E402

from test_mimi import oracle_model, published_names  # noqa: E402
from test_moshi_lm import build_reference, tiny_kwargs, write_published  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
RATE = 24000
FRAME = 1920  # Mimi's 80 ms frame
CARD = 64  # codebook entries (= the LM's audio card): few enough for k-means on a few seconds of latents
MIMI_CFG = replace(MIMI_DEMO, quantizer=replace(MIMI_DEMO.quantizer, bins=CARD))
LM_KWARGS = tiny_kwargs(card=CARD)


def question_24k() -> np.ndarray:
    """The question fixture at 24 kHz with sound above 8 kHz: 8.5-11.5 kHz noise following the
    speech's envelope (as fricatives do), which a 16 kHz stage would remove."""
    x16, rate = sf.read(str(FIXTURES / "question.wav"), dtype="float32")
    assert rate == 16000
    x = soxr.resample(x16, 16000, RATE).astype(np.float64)
    f = np.fft.rfftfreq(x.size, 1 / RATE)
    noise = np.random.default_rng(0).standard_normal(x.size)
    high = np.fft.irfft(np.fft.rfft(noise) * ((f > 8500) & (f < 11500)), x.size)
    envelope = np.convolve(np.abs(x), np.ones(240) / 240, "same")
    y = x + 0.3 * envelope / envelope.max() * high / high.std()
    return (0.5 * y / np.abs(y).max()).astype(np.float32)


def round_trip_16k(x: np.ndarray) -> np.ndarray:
    return soxr.resample(soxr.resample(x, RATE, 16000), 16000, RATE)[:x.size].astype(np.float32)


def kmeans_mimi(train: np.ndarray):
    """The oracle's Mimi (test_mimi's redrawn weights) with its codebooks initialised by the
    oracle's k-means on the latents of ``train``, stage by stage on the residuals, as in training."""
    mimi = oracle_model(MIMI_CFG, seed=3)
    torch.manual_seed(5)  # k-means starts from random samples
    with torch.no_grad():
        latent = mimi._encode_to_unquantized_latent(torch.from_numpy(train)[None, None])
        for rvq in (mimi.quantizer.rvq_first, mimi.quantizer.rvq_rest):
            residual = rvq.input_proj(latent)  # [1, dim, frames]
            for layer in rvq.vq.layers:
                codebook = layer._codebook
                codebook._initialized.fill_(0.0)
                codebook._cached_initialized, codebook._embedding = False, None
                data = layer.project_in(residual.transpose(1, 2))
                codebook._init_embedding(data.reshape(-1, data.shape[-1]))
                codebook._embedding = None  # the cached codewords: recomputed from the new sums
                residual = residual - layer.decode(layer.encode(residual))
    return mimi.eval()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny Moshi checkpoint in the published layout, built with the oracle's classes; the oracle's
    LM and Mimi; a 24 kHz question (as written to a 16-bit WAV, and read back) and its 16 kHz twin."""
    root = tmp_path_factory.mktemp("moshi-rates")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # toy-sized ops: one thread is fastest
    with pytest.MonkeyPatch.context() as mp:
        for name in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "HF_HOME"):
            mp.setenv(name, str(root / "home" / name.lower()))
        ckpt = root / "ckpt"
        ckpt.mkdir()
        question = question_24k()
        interrupt16, _ = sf.read(str(FIXTURES / "interrupt.wav"), dtype="float32")
        train = np.concatenate([question, soxr.resample(interrupt16, 16000, RATE).astype(np.float32),
                                round_trip_16k(question)])
        mimi = kmeans_mimi(train)
        lm = build_reference(LM_KWARGS).eval()
        from safetensors.torch import save_file

        write_published(lm, ckpt / MOSHI_NAME)
        save_file(published_names(mimi.state_dict()), str(ckpt / MIMI_NAME))
        write_demo_tokenizer(ckpt / TOKENIZER_NAME)
        (ckpt / "mimi_config.json").write_text(json.dumps(MIMI_CFG.to_dict()))
        (ckpt / "config.json").write_text(json.dumps({**LM_KWARGS, "model_type": "moshi",
                                                      "mimi_config_name": "mimi_config.json"}))
        wav24, wav16 = root / "question-24k.wav", root / "question-16k.wav"
        sf.write(str(wav24), question, RATE, subtype="PCM_16")
        sf.write(str(wav16), soxr.resample(question, RATE, 16000), 16000, subtype="PCM_16")
        yield SimpleNamespace(root=root, ckpt=ckpt, lm=lm, mimi=mimi, wav24=wav24, wav16=wav16,
                              question=sf.read(str(wav24), dtype="float32")[0],
                              question16=sf.read(str(wav16), dtype="float32")[0])
    torch.set_num_threads(threads)


def oracle_codes(mimi, pcm: np.ndarray) -> torch.Tensor:
    """Kyutai's Mimi, streaming, frame by frame from a fresh state: codes [codebooks, frames]."""
    with torch.no_grad(), mimi.streaming(1):
        return torch.cat([mimi.encode(torch.from_numpy(pcm[i:i + FRAME])[None, None])
                          for i in range(0, pcm.size, FRAME)], dim=-1)[0]


def oracle_text(ref, pcm: np.ndarray) -> list[int | None]:
    """Kyutai's greedy ``LMGen`` (temperature 0) on Kyutai's Mimi codes of ``pcm``: each frame's text
    token, None while the delays fill."""
    gen = LMGen(ref.lm, use_sampling=False)
    out = []
    with torch.no_grad(), ref.mimi.streaming(1), gen.streaming(1):
        for i in range(0, pcm.size, FRAME):
            tokens = gen.step(ref.mimi.encode(torch.from_numpy(pcm[i:i + FRAME])[None, None]))
            out.append(None if tokens is None else int(tokens[0, 0, 0]))
    return out


def after_lead_in(audio: np.ndarray, frames: int) -> np.ndarray:
    """What ``talk`` plays into the model over ``frames`` frames: its lead-in silence, then ``audio``,
    then silence."""
    lead = int(round(LEAD_SILENCE_S / FRAME_S)) * int(round(FRAME_S * RATE))
    pcm = np.zeros(frames * FRAME, np.float32)
    pcm[lead:lead + audio.size] = audio
    return pcm


def talk(ref, wav: Path, tmp_path: Path, monkeypatch) -> tuple[dict, np.ndarray]:
    """``omnidesk talk --greedy --fast --no-vad`` on ``wav``: its timeline's duplex section and what
    the model was handed (every frame given to Mimi's encoder, in order)."""
    heard = []
    encode = MoshiExecutor.encode_audio

    def recording(self, frame):
        heard.append(np.array(frame, np.float32))
        return encode(self, frame)

    monkeypatch.setattr(MoshiExecutor, "encode_audio", recording)
    for name in ("XDG_CACHE_HOME", "XDG_STATE_HOME", "HF_HOME"):
        monkeypatch.setenv(name, str(ref.root / "home" / name.lower()))
    timeline = tmp_path / "t.json"
    rc = cli.main(["talk", "--model", str(ref.ckpt), "--device", "cpu", "--input", str(wav), "--output",
                   str(tmp_path / "o.wav"), "--timeline", str(timeline), "--fast", "--greedy", "--no-vad"])
    assert rc == 0
    return json.loads(timeline.read_text())["duplex"], np.concatenate(heard)


# ---------------------------------------------------------------- talk against Kyutai's LMGen

def test_talk_greedy_text_equals_kyutai_lmgen_on_the_24khz_file(reference, tmp_path, monkeypatch):
    duplex, heard = talk(reference, reference.wav24, tmp_path, monkeypatch)
    steps = duplex["step_text_token_ids"]
    assert len(steps) == len(duplex["step_ms"]) and len(steps) * FRAME == heard.size
    pcm = after_lead_in(reference.question, len(steps))
    assert np.flatnonzero(pcm)[-1] < pcm.size - 10 * FRAME  # the whole question, and silence after it
    expected = oracle_text(reference, pcm)
    cfg = MoshiConfig.from_dict(LM_KWARGS)
    said = [t for t in expected if t is not None and not cfg.is_text_padding(t)]
    print(f"{len(steps)} frames; text tokens {expected[:24]} ...; {len(said)} not padding")
    assert steps == expected  # frame for frame
    # per segment, what the assistant said: together, every non-padding token of the reference
    assert [t for s in duplex["assistant_speech"] for t in s["text_token_ids"]] == said and said
    # the comparison would see a 16 kHz round trip: the oracle on the round-tripped file parts from it
    round_trip = oracle_text(reference, after_lead_in(round_trip_16k(reference.question), len(steps)))
    parted = next(i for i, (a, b) in enumerate(zip(expected, round_trip)) if a != b)
    print(f"with a 16 kHz round trip the text parts at frame {parted} of {len(steps)}")
    assert parted < len(steps) // 2


def test_a_16khz_round_trip_changes_mimis_codes(reference):
    pcm = after_lead_in(reference.question, 40)
    codes = oracle_codes(reference.mimi, pcm)
    again = oracle_codes(reference.mimi, after_lead_in(round_trip_16k(reference.question), 40))
    question = slice(4, 4 + reference.question.size // FRAME)  # the frames that hold the question
    distinct = len({tuple(c) for c in codes[:, question].t().tolist()})
    changed = int((codes[:, question] != again[:, question]).any(0).sum())
    print(f"{distinct} distinct code vectors over {question.stop - question.start} frames of the question; "
          f"a round trip changes {changed} of them")
    assert distinct > 15 and changed > (question.stop - question.start) // 2


# ---------------------------------------------------------------- what the model is handed

def test_talk_hands_mimi_a_24khz_file_as_it_is_and_a_16khz_file_upsampled_once(reference, tmp_path, monkeypatch):
    duplex, heard = talk(reference, reference.wav24, tmp_path, monkeypatch)
    steps = len(duplex["step_ms"])
    np.testing.assert_array_equal(heard, after_lead_in(reference.question, steps))  # bit for bit
    duplex, heard = talk(reference, reference.wav16, tmp_path, monkeypatch)
    once = soxr.resample(reference.question16, 16000, RATE).astype(np.float32)  # what reading the file does
    np.testing.assert_array_equal(heard, after_lead_in(once, len(duplex["step_ms"])))
    # and the user's speech was still found (the speech detector's own 16 kHz copy)
    (start, end), = duplex["user_speech"]
    assert start == pytest.approx(LEAD_SILENCE_S, abs=0.041) and end > start + 2.0


def test_the_sound_file_input_hands_mimi_the_file_as_it_is(reference):
    from omnidesk.gui.file_mic import FileMicSession, read_sound_file

    ex = load_moshi(reference.ckpt, greedy=True)
    assert session_rate(ex) == RATE and vad_rate(ex) == VAD_RATE
    heard = []
    encode = ex.encode_audio
    ex.encode_audio = lambda frame: (heard.append(np.array(frame, np.float32)), encode(frame))[1]
    audio = read_sound_file(reference.wav24, session_rate(ex))  # what the window's "Speak a sound file" reads
    np.testing.assert_array_equal(audio, reference.question)
    session = FileMicSession(ex, realtime=False)
    session.start()
    try:
        session.say(audio)
        deadline = time.monotonic() + 60
        while sum(f.size for f in heard) < audio.size + 4 * FRAME and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        session.close()
    stream = np.concatenate(heard)
    frame = int(round(FRAME_S * RATE))
    start = int(np.flatnonzero(stream)[0]) // frame * frame  # said from the start of a 40 ms frame
    np.testing.assert_array_equal(stream[start:start + audio.size], audio)
    assert not stream[start + audio.size:].any()
    assert session.engine.user_segments, "the speech detector heard nothing"


# ---------------------------------------------------------------- the live path, offline

def tone(hz: float, seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def through(path: CapturePath, mic: np.ndarray, reference: np.ndarray, bypassed: bool, block: int) -> np.ndarray:
    """``mic`` through ``path`` in device blocks, as the session's loop hands it over."""
    frames = []
    for i in range(0, mic.size, block):
        frames += path.push(mic[i:i + block], reference[i:i + block], bypassed)
    assert all(f.size == path.rate * 40 // 1000 for f in frames)
    return np.concatenate(frames)


def level_db(x: np.ndarray) -> float:
    return 20 * np.log10(np.sqrt(np.mean(x.astype(np.float64) ** 2)) / (0.3 / np.sqrt(2)))


def test_live_path_to_mimi_is_one_resample_and_keeps_the_band_above_8khz():
    cancelled = []

    def cancel(mic, reference):  # stands in for the echo canceller: records its rate's frames
        cancelled.append(mic.size)
        return mic

    # speakers, device at the canceller's 48 kHz: canceller, then one 2:1 resample to Mimi's 24 kHz
    path = CapturePath(48000, RATE, 48000, cancel)
    x = tone(10000, 1.0, 48000)
    out = through(path, x, np.zeros_like(x), bypassed=False, block=960)
    assert set(cancelled) == {1920}
    one = Decimator(48000, RATE).offline(x)  # streaming == one-shot (capture.Decimator: why not soxr)
    np.testing.assert_array_equal(out, one[:out.size])
    assert abs(level_db(out[RATE // 10:])) < 0.5  # 10 kHz comes through whole
    assert path.describe(bypassed=False) == "device 48000 Hz -> echo canceller 48000 Hz -> model 24000 Hz"
    # headphones on the same device: the same single resample, the canceller skipped
    cancelled.clear()
    path = CapturePath(48000, RATE, 48000, cancel)
    out2 = through(path, x, np.zeros_like(x), bypassed=True, block=960)
    np.testing.assert_array_equal(out2, out)
    assert path.describe(bypassed=True) == "device 48000 Hz -> model 24000 Hz"

    # headphones, device at 24 kHz: nothing to do, the samples are Mimi's
    path = CapturePath(RATE, RATE, 48000, cancel)
    y = tone(10000, 1.0, RATE) + 0.01 * np.random.default_rng(0).standard_normal(RATE).astype(np.float32)
    cancelled.clear()
    np.testing.assert_array_equal(through(path, y, np.zeros_like(y), bypassed=True, block=480), y)
    assert not cancelled and path.describe(bypassed=True) == "device 24000 Hz -> model 24000 Hz"
    # speakers on that 24 kHz device: up to the canceller's 48 kHz and back, still the whole band
    out = through(path, y, np.zeros_like(y), bypassed=False, block=480)
    assert set(cancelled) == {1920} and abs(level_db(out[RATE // 10:])) < 0.5

    # a turn-based model at 16 kHz: device -> 16 kHz before the canceller, as it always was
    cancelled.clear()
    path = CapturePath(48000, 16000, 16000, cancel)
    z = tone(1000, 1.0, 48000)
    out = through(path, z, np.zeros_like(z), bypassed=False, block=960)
    one = Decimator(48000, 16000).offline(z)
    assert set(cancelled) == {640}
    np.testing.assert_array_equal(out, one[:out.size])


def test_live_session_opens_the_device_for_the_models_rate(monkeypatch):
    """Which rate the session asks the devices for first: the model's with headphones, the canceller's
    on speakers (a duplex model); for a turn-based one a whole multiple of its 16 kHz (the capture
    path's short decimator instead of soxr's 21 ms hold-back), else the devices' own rate."""
    import omnidesk.audio.session as session_mod
    from omnidesk.audio.aec import canceller_rate
    from omnidesk.audio.session import LiveSession, LiveSettings

    asked = []

    class Stop(Exception):
        pass

    def fake_audio(*args, prefer_rates=(), **kwargs):
        asked.append(prefer_rates)
        raise Stop

    monkeypatch.setattr(session_mod, "AudioIO", fake_audio)
    duplex = SimpleNamespace(duplex=True, sample_rate_in=RATE, sample_rate_out=RATE)
    turn = SimpleNamespace(sample_rate_in=16000, sample_rate_out=24000)
    for executor, headphones in ((duplex, True), (duplex, False), (turn, False)):
        with pytest.raises(Stop):
            LiveSession(executor, LiveSettings(headphones=headphones)).start()
    assert asked == [(RATE,), (48000,), (48000, 32000)]
    assert canceller_rate(RATE) == 48000 and canceller_rate(16000) == 16000


# ---------------------------------------------------------------- live, on virtual devices at 24 kHz

@pytest.fixture(scope="module")
def pulse24(tmp_path_factory):
    """A private PulseAudio server whose null sinks run at 24 kHz in float32 mono: what is played into
    the microphone reaches the app sample for sample, with no resampling or conversion on the way."""
    from audio_harness import PulseHarness, ensure_installed

    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    harness = PulseHarness(tmp_path_factory.mktemp("pulse24"), rate=RATE, sample_format="float32le", channels=1)
    try:
        try:
            harness.start()
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"could not start pulseaudio: {e}")
        yield harness
    finally:
        harness.stop()


def delay_of(stream: np.ndarray, clip: np.ndarray) -> int:
    """Where ``clip`` starts in ``stream`` (samples), by cross-correlation (FFT)."""
    n = 1 << int(np.ceil(np.log2(stream.size + clip.size)))
    corr = np.fft.irfft(np.fft.rfft(stream, n) * np.conj(np.fft.rfft(clip, n)), n)[:stream.size - clip.size + 1]
    return int(np.argmax(corr))


def test_live_headphones_at_24khz_mimi_gets_the_codes_of_the_played_file(reference, pulse24):
    from omnidesk.audio.session import LiveSession, LiveSettings

    ex = load_moshi(reference.ckpt, greedy=True)
    heard, codes = [], []
    encode = ex.encode_audio

    def recording(frame):  # the engine's worker thread calls it
        c = encode(frame)
        heard.append(np.array(frame, np.float32))
        codes.append(c.clone())
        return c

    ex.encode_audio = recording
    session = LiveSession(ex, LiveSettings(headphones=True))
    session.start()
    try:
        assert session.audio.rate == RATE
        assert session.hearing == "device 24000 Hz -> model 24000 Hz"
        deadline = time.monotonic() + 15
        while session.frames < 25 and time.monotonic() < deadline:  # the stream runs (1 s of frames)
            time.sleep(0.05)
        assert session.frames >= 25, "no audio from the virtual microphone"
        pulse24.play_into_mic(reference.question, RATE)
        time.sleep(0.6)  # the last frames through the devices and the model
    finally:
        session.close()
    stream, got = np.concatenate(heard), torch.stack(codes, dim=1)
    q = reference.question
    d = delay_of(stream, q)
    print(f"the question reached Mimi after {d} samples ({d / RATE:.3f} s of session); "
          f"max difference {np.abs(stream[d:d + q.size] - q).max():.3g}")
    assert d + q.size <= stream.size, "the recording stopped before the question ended"
    np.testing.assert_array_equal(stream[d:d + q.size], q)  # sample for sample
    # the reference: the file delayed by d samples, through Kyutai's Mimi from the session's first frame
    pcm = np.zeros(stream.size, np.float32)
    pcm[d:d + q.size] = q
    expected = oracle_codes(reference.mimi, pcm)
    frames = slice(d // FRAME, (d + q.size) // FRAME + 1)  # every frame that holds part of the question
    assert torch.equal(got[:, :frames.stop], expected[:, :frames.stop])
    assert len({tuple(c) for c in got[:, frames].t().tolist()}) > 15  # the codes moved with the question
