"""End-to-end audio through a private PulseAudio server: PortAudio (sounddevice) <-> null sinks."""

import threading
import time

import numpy as np
import pytest

sd = pytest.importorskip("sounddevice")

from audio_harness import MIC, SPEAKER, pulse_server  # noqa: E402,F401  (fixture)

SR = 16000


def tone(seconds, f=440.0, rate=SR, amp=0.5):
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * f * t)).astype(np.float32)


def peak_hz(x, rate):
    x = np.asarray(x, dtype=np.float64)
    spec = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    return np.fft.rfftfreq(x.size, 1 / rate)[int(np.argmax(spec))], spec


def test_server_has_virtual_devices(pulse_server):
    sinks = pulse_server.pactl("list", "short", "sinks").stdout
    sources = pulse_server.pactl("list", "short", "sources").stdout
    assert SPEAKER in sinks and MIC in sinks
    assert f"{MIC}.monitor" in sources and f"{SPEAKER}.monitor" in sources
    assert pulse_server.find_device("pulse", "input") >= 0


def test_app_records_tone_played_into_mic(pulse_server):
    dev = pulse_server.find_device("pulse", "input")
    chunks, lock = [], threading.Lock()

    def callback(indata, frames, time_info, status):
        with lock:
            chunks.append(indata[:, 0].copy())

    # The app side: a 40 ms-block input stream on the pulse device, i.e. omnidesk_mic.monitor.
    with sd.InputStream(device=dev, samplerate=SR, channels=1, dtype="float32", blocksize=640,
                        callback=callback):
        time.sleep(0.3)
        pulse_server.play_into_mic(tone(1.0), SR)
        time.sleep(0.3)
    with lock:
        rec = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    assert rec.size >= SR, f"recorded only {rec.size} samples"
    assert np.max(np.abs(rec)) > 0.1, "nothing reached the input stream"
    f, spec = peak_hz(rec, SR)
    assert abs(f - 440) < 5, f
    # The tone dominates: most energy sits within 20 Hz of 440 Hz.
    freqs = np.fft.rfftfreq(rec.size, 1 / SR)
    assert (spec[np.abs(freqs - 440) < 20] ** 2).sum() > 0.9 * (spec ** 2).sum()


def test_app_plays_tone_captured_from_speaker(pulse_server):
    dev = pulse_server.find_device("pulse", "output")
    rec = pulse_server.record_speaker(1.6, rate=SR,
                                      during=lambda: sd.play(tone(1.0, f=440.0), SR, device=dev, blocking=True))
    sd.stop()
    assert np.max(np.abs(rec)) > 0.1, "nothing captured from omnidesk_speaker.monitor"
    f, _ = peak_hz(rec, SR)
    assert abs(f - 440) < 5, f
