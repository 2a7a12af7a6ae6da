import numpy as np
import pytest

from omnidesk.engine.speaker import VirtualSpeaker

SR = 24000
BLOCK = 960


def ramp(n, start=0):
    """Distinct, slowly varying samples so positions can be checked exactly."""
    return ((np.arange(start, start + n) % 1000) / 1000.0).astype(np.float32)


def sine(n, f=440.0, amp=0.5):
    return (amp * np.sin(2 * np.pi * f * np.arange(n) / SR)).astype(np.float32)


def test_playhead_counts_only_played_samples():
    sp = VirtualSpeaker(SR, BLOCK)
    sp.start_reply()
    assert sp.write(ramp(2500))
    sp.end_reply()  # the whole reply: its end plays as it is (no underrun fade)
    assert sp.playhead == 0 and sp.buffered_samples == 2500
    sp.tick()
    assert sp.playhead == BLOCK
    sp.tick()
    sp.tick()  # only 580 left: partial block then silence
    assert sp.playhead == 2500 and sp.buffered_samples == 0
    assert sp.heard_s == pytest.approx(2500 / SR)
    rec = sp.recording()
    np.testing.assert_array_equal(rec[:2500], ramp(2500))
    assert not rec[2500:].any()


def test_reply_first_sample_marks_playback_start():
    sp = VirtualSpeaker(SR, BLOCK)
    sp.tick()
    sp.tick()
    sp.start_reply()
    sp.write(ramp(100))
    sp.tick()
    assert sp.reply_first_sample == 2 * BLOCK


def test_flush_drops_unplayed_and_reports_count():
    sp = VirtualSpeaker(SR, BLOCK, fade_ms=5.0)
    fade = int(0.005 * SR)
    sp.start_reply()
    sp.write(ramp(10 * BLOCK))
    sp.tick()
    sp.tick()
    dropped = sp.flush()
    assert dropped == 8 * BLOCK - fade
    assert sp.buffered_samples == fade  # the fade tail still plays
    sp.tick()
    sp.tick()
    assert sp.playhead == 2 * BLOCK + fade
    assert sp.buffered_samples == 0
    assert not sp.reply_active
    assert sp.underruns == 0


def test_flush_fade_has_no_click():
    sp = VirtualSpeaker(SR, BLOCK)
    x = sine(20 * BLOCK)
    own_step = np.abs(np.diff(x)).max()
    sp.start_reply()
    sp.write(x)
    # Cut where the sine is near its peak, the worst case for a click.
    n_before = 3 * BLOCK + int(np.argmax(np.abs(x[3 * BLOCK : 4 * BLOCK])))
    sp.tick(n_before)
    assert abs(x[n_before]) > 0.45
    sp.flush()
    for _ in range(3):
        sp.tick()
    rec = sp.recording()
    # A linear fade adds at most amp/fade_len to the sine's own step.
    assert np.abs(np.diff(rec)).max() <= own_step * 1.01
    assert rec[-BLOCK:].max() == 0.0
    # Without the fade the same cut would jump by about the amplitude.
    hard = VirtualSpeaker(SR, BLOCK)
    hard.start_reply()
    hard.write(x)
    hard.tick(n_before)
    hard.flush(fade_ms=0)
    hard.tick()
    assert np.abs(np.diff(hard.recording())).max() > 0.4


def test_pause_resume_continuity():
    sp = VirtualSpeaker(SR, BLOCK)
    fade = int(round(sp.fade_ms * SR / 1000))  # 120 samples
    x = ramp(5 * BLOCK)
    sp.start_reply()
    sp.write(x)
    sp.end_reply()
    sp.tick()
    sp.pause()
    out = sp.tick()
    # the pause fades out over `fade` more samples (they play and count), then silence
    np.testing.assert_allclose(out[:fade], x[BLOCK:BLOCK + fade] * (1 - np.arange(1, fade + 1) / fade), atol=1e-6)
    assert not out[fade:].any()
    for _ in range(2):
        assert not sp.tick().any()
    assert sp.playhead == BLOCK + fade and sp.buffered_samples == 4 * BLOCK - fade
    assert sp.underruns == 0  # paused is not an underrun
    sp.resume()
    for _ in range(4):
        sp.tick()
    rec = sp.recording()
    back = rec[4 * BLOCK:]  # from exactly the sample after the last one played, faded in
    np.testing.assert_allclose(back[:fade], x[BLOCK + fade:BLOCK + 2 * fade] * np.arange(1, fade + 1) / fade,
                               atol=1e-6)
    np.testing.assert_array_equal(back[fade:4 * BLOCK - fade], x[BLOCK + 2 * fade:])
    np.testing.assert_array_equal(rec[:BLOCK], x[:BLOCK])
    assert sp.playhead == 5 * BLOCK


def test_underrun_fades_out_and_back_in():
    # a reply that runs dry mid-way (the vocoder fell behind) must not click either side of the gap
    sp = VirtualSpeaker(SR, BLOCK)
    fade = int(round(sp.fade_ms * SR / 1000))
    level = np.full(BLOCK + 500, 0.5, np.float32)
    sp.start_reply()
    sp.write(level)
    sp.tick()
    gap = sp.tick()  # 500 samples left, then dry
    assert sp.underruns == 1
    assert gap[0] == 0.5 and gap[500 - fade - 1] == 0.5
    assert gap[499] == pytest.approx(0.5 / fade) and not gap[500:].any()
    sp.write(level)
    back = sp.tick()
    np.testing.assert_allclose(back[:fade], 0.5 * np.arange(1, fade + 1) / fade, rtol=1e-6)
    assert (back[fade:] == 0.5).all()
    # largest step between neighbouring samples: one ramp step, never the full level
    assert np.abs(np.diff(sp.recording())).max() <= 0.5 / fade + 1e-6
    assert sp.playhead == 2 * BLOCK + 500  # every sample that played, faded or not


def test_recording_length_is_ticks_times_n():
    sp = VirtualSpeaker(SR, BLOCK)
    sp._rec_chunk = 1000  # force several recording chunks
    sp.start_reply()
    sp.write(ramp(3000))
    for _ in range(7):
        sp.tick(333)
    assert len(sp.recording()) == 7 * 333 == sp.clock_samples
    np.testing.assert_array_equal(sp.recording()[:2331], ramp(2331))


def test_underruns_only_while_reply_active():
    sp = VirtualSpeaker(SR, BLOCK)
    for _ in range(3):
        sp.tick()  # idle: no reply
    sp.start_reply()
    sp.tick()  # waiting for the first chunk is latency, not an underrun
    assert sp.underruns == 0
    sp.write(ramp(BLOCK + 10))
    sp.tick()
    assert sp.underruns == 0
    sp.tick()  # 10 samples, then starved
    assert sp.underruns == 1
    sp.tick()
    assert sp.underruns == 2
    sp.write(ramp(BLOCK + 10))
    sp.end_reply()
    sp.tick()
    sp.tick()  # the tail runs dry after end_reply: not an underrun
    assert sp.underruns == 2
    assert not sp.reply_active
    sp.tick()
    assert sp.underruns == 2


def test_capacity_backpressure():
    sp = VirtualSpeaker(SR, BLOCK, capacity_s=0.1)  # 2400 samples
    assert sp.capacity == 2400
    assert sp.write(ramp(2000))
    assert not sp.write(ramp(500))  # does not fit: nothing queued
    assert sp.buffered_samples == 2000 and sp.free_samples == 400
    sp.tick()
    assert sp.write(ramp(500))  # room after playing a block
    with pytest.raises(ValueError):
        sp.write(ramp(2401))  # could never fit


def test_ring_wraps_and_flush_tail_not_counted_in_next_reply():
    sp = VirtualSpeaker(SR, BLOCK, capacity_s=0.1)
    x = ramp(6 * BLOCK)
    sp.start_reply()
    pos = 0
    while pos < len(x) or sp.buffered_samples:
        if pos < len(x) and sp.write(x[pos : pos + 700]):
            pos += 700
            continue
        sp.tick()
    np.testing.assert_array_equal(sp.recording()[: len(x)], x)
    # A new reply started while a flush's fade tail is still buffered.
    sp.start_reply()
    sp.write(ramp(2000))
    sp.tick()
    sp.flush()
    tail = sp.buffered_samples
    sp.start_reply()
    sp.write(ramp(500))
    sp.tick()
    assert sp.playhead == 500
    assert sp.reply_first_sample == sp.clock_samples - BLOCK + tail
