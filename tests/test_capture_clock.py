"""The live session's clock: frames stamped with when the microphone heard them (PortAudio's ADC
times, less the echo canceller's lag), so that a turn's voice-to-voice is what the user hears.

Offline: :class:`~omnidesk.audio.capture.CapturePath` on known device times, :class:`AudioIO`'s
input callback on made-up PortAudio time infos, the canceller's lag against a cross-correlation
of its input and output.  The same on real (virtual) devices, against recordings:
tests/test_live.py::test_question_gets_reply_after_it_ends; on human speech: bench/live_latency.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from omnidesk.audio.capture import RESYNC_S, CapturePath


def stamps(path: CapturePath, blocks: list[tuple[float | None, int]], bypassed: bool = False) -> list[float]:
    """Push device blocks of (ADC time or None, samples); the stamps of the frames that came out."""
    out = []
    for t, n in blocks:
        out += [s for s, _ in path.timed(np.zeros(n, np.float32), np.zeros(n, np.float32), bypassed, t)]
    return out


def test_frames_carry_the_device_time_of_their_first_sample():
    # 44.1 kHz device -> 16 kHz model, 20 ms blocks starting at session time 0.5
    path = CapturePath(44100, 16000, 16000, lambda mic, ref: mic)
    blocks = [(0.5 + 0.02 * i, 882) for i in range(50)]
    got = stamps(path, blocks)
    assert len(got) == 24  # 1 s minus what the resampler still holds
    np.testing.assert_allclose(got, 0.5 + 0.04 * np.arange(len(got)), atol=1e-9)
    # without times the stamps go on counting samples from the last known one
    more = stamps(path, [(None, 882)] * 10)
    np.testing.assert_allclose(more, got[-1] + 0.04 * np.arange(1, len(more) + 1), atol=1e-9)


def test_a_dropped_block_or_a_drifting_card_moves_the_stamps_to_the_device_time():
    path = CapturePath(16000, 16000, 16000, lambda mic, ref: mic)
    # 10 blocks, then 100 ms of capture lost (the engine stalled: the ring overflowed)
    got = stamps(path, [(0.02 * i, 320) for i in range(10)] + [(0.3 + 0.02 * i, 320) for i in range(10)])
    np.testing.assert_allclose(got[:5], 0.04 * np.arange(5), atol=1e-9)
    np.testing.assert_allclose(got[5:], 0.3 + 0.04 * np.arange(5), atol=1e-9)
    # a card whose clock runs 0.1% fast against the stream clock: stamps follow within RESYNC_S
    path = CapturePath(16000, 16000, 16000, lambda mic, ref: mic)
    got = stamps(path, [(0.02 * i * 1.001, 320) for i in range(3000)])
    truth = 0.04 * np.arange(len(got)) * 1.001
    assert np.max(np.abs(np.array(got) - truth)) <= RESYNC_S + 1e-9
    assert all(b >= a for a, b in zip(got, got[1:]))  # never back in time


def test_the_cancellers_lag_is_taken_off_the_stamps_while_it_runs():
    path = CapturePath(16000, 16000, 16000, lambda mic, ref: mic, canceller_delay_s=0.014)
    got = stamps(path, [(1.0 + 0.02 * i, 320) for i in range(4)])
    np.testing.assert_allclose(got, [1.0 - 0.014, 1.04 - 0.014], atol=1e-9)
    # headphones (the canceller bypassed): no lag to take off
    path = CapturePath(16000, 16000, 16000, lambda mic, ref: mic, canceller_delay_s=0.014)
    np.testing.assert_allclose(stamps(path, [(1.0 + 0.02 * i, 320) for i in range(4)], bypassed=True),
                               [1.0, 1.04], atol=1e-9)


def test_audio_io_reads_carry_the_adc_time_of_their_first_sample():
    from omnidesk.audio.device import AudioIO

    io = AudioIO.__new__(AudioIO)  # its callbacks and ring only: no PortAudio stream
    io.rate, io.block = 16000, 320
    io._ring_size = 16000
    io._mic_ring = np.zeros(io._ring_size, np.float32)
    io._ref_ring = np.zeros(io._ring_size, np.float32)
    io._played_ring = np.zeros(8000, np.float32)
    io._played = 0
    io._written = io._read = 0
    io.callbacks = io.capture_overflows = io.input_overflows = 0
    io._blk_index = np.full(256, -1, dtype=np.int64)
    io._blk_adc = np.zeros(256)
    block = np.zeros((320, 1), np.float32)
    for i in range(5):
        io._input_callback(block, 320, SimpleNamespace(inputBufferAdcTime=100.0 + 0.02 * i, currentTime=0.0), None)
    mic, ref, t = io.read()
    assert mic.size == 1600 and t == pytest.approx(100.0)
    io._input_callback(block, 320, SimpleNamespace(inputBufferAdcTime=100.1, currentTime=0.0), None)
    assert io.read()[2] == pytest.approx(100.1)
    assert io.read()[2] is None  # nothing new
    # a host API without ADC times: the time the block arrived, less its length
    io._input_callback(block, 320, SimpleNamespace(inputBufferAdcTime=0.0, currentTime=100.14), None)
    assert io.read()[2] == pytest.approx(100.12)


def test_the_cancellers_lag_is_measured():
    pytest.importorskip("livekit.rtc")
    from omnidesk.audio.aec import EchoCanceller

    for ns in (False, True):
        aec = EchoCanceller(16000, noise_suppression=ns, warm_up_s=0.0)
        lag = aec.processing_delay_s()
        # a click through it comes out that much later
        x = np.zeros(16000, np.float32)
        x[8000] = 0.5
        y = np.concatenate([aec.process(x[i:i + 640], np.zeros(640, np.float32)) for i in range(0, 16000, 640)])
        assert abs(int(np.argmax(np.abs(y[7000:]))) + 7000 - 8000 - lag * 16000) <= 16  # within 1 ms
        aec.bypass = True
        assert aec.processing_delay_s() == 0.0


@pytest.mark.parametrize("rate_in,rate_out", [(48000, 16000), (48000, 24000), (32000, 16000)])
def test_decimator_holds_back_little_and_keeps_samples_in_place(rate_in, rate_out):
    """capture.Decimator against what it replaces on the microphone's path (soxr HQ): in step with a
    one-shot run, sample k at input sample factor * k, flat to 90 % of the band, >= 79 dB down past
    110 %, and what it holds back of each block a couple of ms where soxr holds back ~20."""
    import soxr

    from omnidesk.audio.capture import Decimator

    d = Decimator(rate_in, rate_out)
    x = np.random.default_rng(0).standard_normal(rate_in).astype(np.float32)
    block = rate_in // 50
    y = np.concatenate([d(x[i:i + block]) for i in range(0, x.size, block)])
    np.testing.assert_allclose(y, d.offline(x)[:y.size], atol=1e-6)
    held_ms = (rate_out - y.size) / rate_out * 1000
    rs = soxr.ResampleStream(rate_in, rate_out, 1, dtype="float32", quality="HQ")
    soxr_ms = (rate_out - sum(rs.resample_chunk(x[i:i + block]).size for i in range(0, x.size, block))) / rate_out * 1000
    assert held_ms <= 2.0 and soxr_ms >= 10.0
    # an impulse comes out where it went in
    d.clear()
    z = np.zeros(rate_in, np.float32)
    z[d.factor * 700] = 1.0
    assert int(np.argmax(np.concatenate([d(z[i:i + block]) for i in range(0, z.size, block)]))) == 700

    def gain_db(f):
        return 20 * np.log10(abs(np.sum(d.taps * np.exp(-2j * np.pi * f / rate_in * np.arange(d.taps.size)))))

    nyq = rate_out / 2
    assert all(abs(gain_db(f)) < 0.1 for f in np.linspace(50, 0.9 * nyq, 40))
    assert all(gain_db(f) < -79 for f in np.linspace(1.1 * nyq, rate_in / 2, 80))


@pytest.mark.parametrize("device_rate,rate,canceller_rate,bypassed", [
    (48000, 16000, 16000, False),  # Qwen on speakers: device -> 16 kHz, canceller, model
    (48000, 24000, 48000, False),  # Moshi on speakers: canceller at 48 kHz, then -> 24 kHz
    (96000, 24000, 48000, True),  # Moshi on headphones from a 96 kHz device: one 4:1 decimation
])
def test_each_frame_comes_out_with_the_block_that_holds_its_last_sample(device_rate, rate, canceller_rate,
                                                                        bypassed):
    """A decimator holds back ~1.6 ms: frames cut from the first sample were whole only one block
    (20 ms) after their last sample arrived.  Given the device's block, the path drops a little of
    the start instead, so that every frame is out with the block that holds its last sample; its
    stamp is still the ADC time of its first sample, and the samples are the one-shot filter's."""
    from omnidesk.audio.capture import Decimator

    block = device_rate // 50
    late = CapturePath(device_rate, rate, canceller_rate, lambda mic, ref: mic)
    path = CapturePath(device_rate, rate, canceller_rate, lambda mic, ref: mic, block=block)
    x = np.random.default_rng(0).standard_normal(device_rate).astype(np.float32)
    t0 = 2.0
    got, waits, late_waits = [], [], []
    for b in range(x.size // block):
        chunk = x[b * block:(b + 1) * block]
        t_block = t0 + b * block / device_rate
        for stamp, frame in path.timed(chunk, chunk, bypassed, t_block):
            last = stamp + (frame.size - 1) / rate  # the frame's last sample, on the device clock
            waits.append(t_block + block / device_rate - last)  # from it to the end of this block
            got.append((stamp, frame))
        for stamp, frame in late.timed(chunk, chunk, bypassed, t_block):
            late_waits.append(t_block + block / device_rate - (stamp + (frame.size - 1) / rate))
    assert len(got) >= 20
    assert max(waits) <= block / device_rate  # out with the block that holds its last sample
    assert min(late_waits) > block / device_rate  # cut from the first sample: a block later
    lead = got[0][0] - t0  # what was dropped at the start: less than a frame
    assert 0 < lead < 0.04
    np.testing.assert_allclose([s for s, _ in got], got[0][0] + 0.04 * np.arange(len(got)), atol=1e-9)
    out = np.concatenate([f for _, f in got])
    kept = x[int(round(lead * device_rate)):]
    if device_rate // canceller_rate > 1 and not bypassed:  # two stages: device -> canceller -> model
        one = Decimator(device_rate, canceller_rate).offline(kept)
        one = one if canceller_rate == rate else Decimator(canceller_rate, rate).offline(one)
    elif canceller_rate != rate and not bypassed:
        one = Decimator(canceller_rate, rate).offline(kept)
    else:
        one = Decimator(device_rate, rate).offline(kept)
    np.testing.assert_allclose(out, one[:out.size], atol=1e-6)


def _soxr_streams(root) -> int:
    """soxr streams reachable from ``root``."""
    import gc

    import soxr

    seen, stack, found = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, np.ndarray)):
            continue
        seen.add(id(obj))
        if isinstance(obj, soxr.ResampleStream):
            found += 1
            continue
        stack.extend(gc.get_referents(obj))
    return found


def test_a_closed_capture_path_holds_no_soxr_stream():
    """A soxr stream still alive when Python exits makes nanobind print a "leaked instances" block
    after every run that used a 44.1 kHz device; the session releases its path when it closes."""
    path = CapturePath(44100, 16000, 16000, lambda mic, ref: mic)
    block = np.zeros(4410, np.float32)
    list(path.timed(block, block, False, 0.0))
    assert _soxr_streams(path) >= 1
    path.release()
    assert _soxr_streams(path) == 0
