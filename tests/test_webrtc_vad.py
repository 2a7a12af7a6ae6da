"""WebRtcVAD: the webrtcvad-backed SpeechDetector, alone and driving the Endpointer."""

import shutil
import subprocess
import wave

import numpy as np
import pytest

pytest.importorskip("webrtcvad")

from omnidesk.audio.vad import WebRtcVAD, WebRtcVADConfig  # noqa: E402
from omnidesk.engine.vad import Endpoint, Endpointer, EndpointerConfig, SpeechStart  # noqa: E402

SR = 16000
FRAME = 640  # 40 ms
DT = FRAME / SR


def frames(x):
    n = len(x) // FRAME
    return [x[i * FRAME:(i + 1) * FRAME] for i in range(n)]


def noise(seconds, level, seed=0):
    return (np.random.default_rng(seed).standard_normal(int(round(seconds * SR))) * level).astype(np.float32)


def speech_like(seconds, seed=0):
    """Voiced harmonics of a moving f0 (~150 Hz) with a 4 Hz syllable envelope plus a little noise."""
    t = np.arange(int(round(seconds * SR))) / SR
    f0 = 150 + 30 * np.sin(2 * np.pi * 0.8 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    # Formant-ish spectral tilt: strong low harmonics, weaker up to ~3 kHz.
    wave_ = sum((0.5 / k) * np.sin(k * phase) for k in range(1, 20))
    env = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)
    x = 0.3 * wave_ * env + noise(seconds, 0.003, seed)
    return x.astype(np.float32)


def resample(x, src, dst):
    """Band-limited FFT resampling (numpy only)."""
    n_out = int(round(len(x) * dst / src))
    spec = np.fft.rfft(x)
    keep = n_out // 2 + 1
    spec = spec[:keep] if keep <= spec.size else np.pad(spec, (0, keep - spec.size))
    return (np.fft.irfft(spec, n_out) * (n_out / len(x))).astype(np.float32)


@pytest.fixture(scope="module")
def espeak_speech(tmp_path_factory):
    """Real synthetic speech from espeak-ng (16 kHz float32), made once into a tmp file."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng not installed (apt-get install espeak-ng)")
    path = tmp_path_factory.mktemp("espeak") / "utt.wav"
    subprocess.run([exe, "-v", "en", "-s", "150", "-w", str(path),
                    "Hello there, please turn the kitchen lights off and play some music."],
                   check=True, timeout=30, capture_output=True)
    with wave.open(str(path)) as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
    return resample(x, rate, SR) if rate != SR else x


# ------------------------------------------------------------------ config / errors


def test_config_validation():
    assert WebRtcVADConfig().aggressiveness == 2
    for bad in (-1, 4, 2.0, True):
        with pytest.raises(ValueError, match="aggressiveness"):
            WebRtcVADConfig(bad)
    with pytest.raises(ValueError, match="aggressiveness"):
        WebRtcVAD(aggressiveness=5)
    assert WebRtcVAD(config=WebRtcVADConfig(3)).aggressiveness == 3


def test_bad_frame_length_names_lengths():
    vad = WebRtcVAD()
    for n in (320, 480, 639, 1280, 0):
        with pytest.raises(ValueError, match=rf"{n} samples.*640 samples"):
            vad.is_speech(np.zeros(n, dtype=np.float32))


def test_bad_sample_rate_named():
    with pytest.raises(ValueError, match="22050"):
        WebRtcVAD(sample_rate=22050)
    # Other webrtcvad rates work with their own 40 ms frame.
    vad = WebRtcVAD(sample_rate=8000)
    assert vad.is_speech(np.zeros(320, dtype=np.float32)) is False


# ------------------------------------------------------------------ decisions


def test_silence_is_not_speech():
    vad = WebRtcVAD()
    assert not any(vad.is_speech(f) for f in frames(np.zeros(SR, dtype=np.float32)))


def warmed(vad, seconds=0.4, level=1e-3, seed=9):
    """WebRTC VAD calls the first 2-3 frames of a fresh stream of -60 dBFS noise speech while its
    noise model adapts; a microphone stream that has been open a moment is past that."""
    for f in frames(noise(seconds, level, seed)):
        vad.is_speech(f)
    return vad


def test_low_noise_is_not_speech_at_aggressiveness_3():
    vad = WebRtcVAD(aggressiveness=3)
    decisions = [vad.is_speech(f) for f in frames(noise(2.0, 1e-3))]
    assert sum(decisions[:3]) <= 3 and sum(decisions[3:]) == 0, decisions  # warm-up, then quiet
    vad = warmed(WebRtcVAD(aggressiveness=3))
    assert not any(vad.is_speech(f) for f in frames(noise(2.0, 1e-3, seed=4)))
    # Very low noise (-80 dBFS) is quiet from the first frame.
    vad = WebRtcVAD(aggressiveness=3)
    assert not any(vad.is_speech(f) for f in frames(noise(1.0, 1e-4)))


def test_clipping_out_of_range_input():
    vad = WebRtcVAD()
    loud = speech_like(0.04) * 50  # far outside [-1, 1]: must clip, not wrap around
    assert isinstance(vad.is_speech(loud), bool)


def test_speech_like_signal_is_speech():
    vad = WebRtcVAD()
    decisions = [vad.is_speech(f) for f in frames(speech_like(2.0))]
    assert np.mean(decisions) >= 0.8, decisions


def test_real_speech_is_speech_on_voiced_frames(espeak_speech):
    vad = WebRtcVAD()
    fs = frames(espeak_speech)
    rms = np.array([np.sqrt(np.mean(f.astype(np.float64) ** 2)) for f in fs])
    voiced = rms > 0.1 * rms.max()  # loud (vowel) frames
    assert voiced.sum() >= 20
    decisions = np.array([vad.is_speech(f) for f in fs])
    assert decisions[voiced].mean() >= 0.9, decisions[voiced].mean()


def test_either_half_counts():
    """Speech starting in the second half of a frame already makes that frame speech."""
    sp = speech_like(1.0)
    vad = WebRtcVAD(aggressiveness=0)
    for f in frames(sp)[:10]:  # warm up on speech so the onset is not in doubt
        vad.is_speech(f)
    half = np.concatenate([np.zeros(FRAME // 2, np.float32), sp[:FRAME // 2]])
    assert vad.is_speech(half)


# ------------------------------------------------------------------ with the Endpointer


def _drive(ep, x):
    events = []
    for i, f in enumerate(frames(x)):
        events += ep.push(f, i * DT)
    return events


@pytest.mark.parametrize("source", ["synthetic", "espeak"])
def test_endpointer_with_webrtc_vad(source, request):
    speech = speech_like(1.5) if source == "synthetic" else request.getfixturevalue("espeak_speech")
    lead, tail = 1.0, 1.0
    # One continuous room-noise floor under the whole take (a jump in the floor, e.g. from
    # espeak's digital-silence tail to noise, is itself called speech for a while).
    x = np.concatenate([np.zeros(int(lead * SR), np.float32), speech, np.zeros(int(tail * SR), np.float32)])
    x = x + noise(len(x) / SR, 1e-3, 1)[: len(x)]
    speech_end = lead + len(speech) / SR
    if source == "espeak":
        # espeak pads its output with silence; measure where the sound really is.
        idx = np.flatnonzero(np.abs(speech) > 0.02)
        speech_on, speech_end = lead + idx[0] / SR, lead + idx[-1] / SR
    else:
        speech_on = lead
    ep = Endpointer(warmed(WebRtcVAD()), EndpointerConfig())
    events = _drive(ep, x)
    starts = [e for e in events if isinstance(e, SpeechStart)]
    ends = [e for e in events if isinstance(e, Endpoint)]
    assert len(starts) == 1 and len(ends) == 1, events
    start, end = starts[0], ends[0]
    # Start back-dated to within a couple of frames of the real onset, confirmed ~120 ms later.
    assert abs(start.t - speech_on) <= 0.1, (start, speech_on)
    assert start.t_confirmed - start.t == pytest.approx(0.12, abs=0.045)
    # The speech end is found in the audio, where the voice stopped (the detector holds "speech"
    # for a while past it); the endpoint follows 400 ms of the detector's silence, so it lies
    # 400 ms plus the detector's hold-over (at most the voice-end search window) after it.
    assert abs(end.t_speech_end - speech_end) <= 0.06, (end, speech_end)
    cfg = EndpointerConfig()
    hold = end.t_endpoint - end.t_speech_end - cfg.endpoint_silence_ms / 1000
    assert -DT / 2 <= hold <= cfg.speech_end_search_ms / 1000 + DT / 2, (end, hold)
    assert not end.forced
