"""Real audio devices: an input and an output PortAudio stream, ring buffers, and a speaker the engine can drive.

Threads.  PortAudio calls the output and input callbacks of :class:`AudioIO`
on its own threads every block (``block_ms``).  They only copy: the speaker's
buffered reply into the output (through :meth:`VirtualSpeaker.tick_into`) and
into a short "played" ring; captured samples into the capture ring, each block
paired with the latest played samples (the echo canceller's reference); plus a
few counters.  They allocate no buffers and log nothing.  The one wait: the
speaker's lock, for at most ``LOCK_WAIT_S`` (1 ms of a 10 ms block).  The
engine holds it only for short copies, but a Python thread can be descheduled
inside them (the GIL's 5 ms switch interval); a plain try-lock then missed
0-3 blocks per 10 s reply on a 2-core machine, each a block-long dropout with hard
edges (a click, and an echo the canceller lets through).  A timed acquire
releases the GIL, so the holder finishes and the callback goes on.  Still
busy after that: the block plays silence and ``lock_misses`` counts it.  Why
two streams rather than one duplex stream: see :class:`AudioIO`.

Rates.  Both streams run at one rate both devices accept: the rates the
session prefers first (a full-duplex model's own rate, or its echo
canceller's, see omnidesk.audio.capture), then the devices' native rates.
:class:`DeviceSpeaker` takes 24 kHz model audio and resamples it to the
device rate (soxr, streaming, on the engine's thread); the session takes
capture and reference to the model's rate the same way
(omnidesk.audio.capture).

Playhead.  ``DeviceSpeaker.playhead`` counts reply samples that reached the
DAC by now, from PortAudio's timing info (``outputBufferDacTime`` of each
block against the stream clock): samples handed to the device but still in
its buffer were not heard and must not be kept in the conversation.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from omnidesk.engine.speaker import VirtualSpeaker

# Rates tried after the devices' own defaults, best first.
FALLBACK_RATES = (48000, 44100, 32000, 24000, 16000)
# Callback period and the device buffering asked of PortAudio.  The output stream hands a block to
# the DAC about latency + one block after it is rendered: what the user waits for on every reply
# and every barge-in (audio already handed to the device still plays).  Measured with
# bench/live_latency.py (PulseAudio virtual devices, 6 questions, fixed end of turn, CPU demo):
# 50 ms / 20 ms blocks -> a reply reached the DAC 80 ms after it was written, acoustic
# voice-to-voice 604 ms idle, 606 with one core busy; 20 ms / 10 ms blocks -> 30 ms, 548 / 535 ms,
# with no dropout heard in any reply (the 50 ms setting had one 10 ms dropout per reply).  Twice
# the callbacks: each only copies.
DEFAULT_BLOCK_MS = 10.0
DEFAULT_LATENCY_S = 0.02
CAPTURE_RING_S = 2.0  # the engine loop may stall this long before capture overflows
_TIMING_SLOTS = 256  # per-block DAC times kept for the playhead (>= output latency / block)
LOCK_WAIT_S = 0.001  # longest the output callback waits for the speaker's lock (see the module doc)


class AudioDeviceError(RuntimeError):
    """A device is missing, refuses the settings, or stopped; the message is for the user."""


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    inputs: int
    outputs: int
    default_rate: float
    hostapi: str
    is_default_input: bool
    is_default_output: bool


def _sd():
    try:
        import sounddevice as sd
    except OSError as e:  # libportaudio2 missing
        raise AudioDeviceError(f"PortAudio is not available ({e}); install libportaudio2") from None
    return sd


_open_streams = 0  # AudioIO objects with open streams: PortAudio must not be re-initialised under them


def list_devices() -> list[DeviceInfo]:
    """Every input/output device PortAudio sees.  Re-enumerated (plugged/unplugged devices show up)
    only while no stream is open: re-initialising PortAudio would kill open streams."""
    sd = _sd()
    try:
        if _open_streams == 0:
            sd._terminate()  # PortAudio enumerates once per initialisation
            sd._initialize()
        devices = sd.query_devices()
        hostapis = sd.query_hostapis()
        default_in, default_out = sd.default.device
    except sd.PortAudioError as e:
        raise AudioDeviceError(f"cannot list audio devices: {e}") from None
    if default_in is None or default_in < 0:
        default_in = next((h["default_input_device"] for h in hostapis if h["default_input_device"] >= 0), -1)
    if default_out is None or default_out < 0:
        default_out = next((h["default_output_device"] for h in hostapis if h["default_output_device"] >= 0), -1)
    return [DeviceInfo(index=i, name=d["name"], inputs=d["max_input_channels"], outputs=d["max_output_channels"],
                       default_rate=float(d["default_samplerate"]), hostapi=hostapis[d["hostapi"]]["name"],
                       is_default_input=i == default_in, is_default_output=i == default_out)
            for i, d in enumerate(devices)]


def resolve_device(spec: str | int | None, kind: str, devices: list[DeviceInfo] | None = None) -> DeviceInfo:
    """The ``kind`` ("input" or "output") device for ``spec``: None = the system default, an index,
    or a name (exact, else the first case-insensitive substring match)."""
    devices = list_devices() if devices is None else devices
    usable = [d for d in devices if (d.inputs if kind == "input" else d.outputs) > 0]
    what = "microphone (input)" if kind == "input" else "speaker (output)"
    if not usable:
        raise AudioDeviceError(f"no {what} device found; connect one, or check that the sound server runs")
    if spec is None or spec == "":
        return next((d for d in usable if (d.is_default_input if kind == "input" else d.is_default_output)),
                    usable[0])
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        index = int(spec)
        for d in usable:
            if d.index == index:
                return d
    else:
        for d in usable:
            if d.name == spec:
                return d
        for d in usable:
            if spec.lower() in d.name.lower():
                return d
    names = "; ".join(f"{d.index}: {d.name}" for d in usable)
    raise AudioDeviceError(f"{what} {spec!r} not found (it may have been unplugged); available: {names}")


def choose_rate(inp: DeviceInfo, out: DeviceInfo, in_channels: int, out_channels: int,
                prefer: tuple[int, ...] = ()) -> int:
    """A sample rate both devices accept (float32 streams): ``prefer`` first, then their native rates."""
    sd = _sd()
    tried = []
    for rate in (*prefer, out.default_rate, inp.default_rate, *FALLBACK_RATES):
        rate = int(round(rate))
        if rate <= 0 or rate in tried:
            continue
        tried.append(rate)
        try:
            sd.check_input_settings(device=inp.index, samplerate=rate, channels=in_channels, dtype="float32")
            sd.check_output_settings(device=out.index, samplerate=rate, channels=out_channels, dtype="float32")
        except sd.PortAudioError:
            continue
        return rate
    raise AudioDeviceError(f"no sample rate works for both {inp.name!r} and {out.name!r} "
                           f"(tried {', '.join(f'{r} Hz' for r in tried)})")


class DeviceSpeaker:
    """The engine's speaker on a real device: same interface as :class:`VirtualSpeaker`, in model
    samples (24 kHz), played by the output stream's callback at the device rate."""

    def __init__(self, device_rate: int, model_rate: int = 24000, block: int = 960,
                 capacity_s: float = 6.0, fade_ms: float = 5.0):
        import soxr

        self.sample_rate = model_rate
        self.device_rate = device_rate
        self._ratio = device_rate / model_rate
        self.block = max(1, int(round(block / self._ratio)))  # the callback period, in model samples
        self._inner = VirtualSpeaker(sample_rate=device_rate, block=block, capacity_s=capacity_s,
                                     fade_ms=fade_ms, record=False)
        self._lock = threading.Lock()
        self._soxr = soxr
        self._rs = None  # created on a reply's first write; dropped after its tail and by flush()
        self._rs_in = 0  # model samples into the resampler since its last clear
        self._rs_out = 0  # device samples out of it
        # Per callback block (ring, written by the callback under the lock): DAC time of the block's
        # first sample, reply playhead before it and reply samples in it, reply generation.
        self._dac = np.zeros(_TIMING_SLOTS)
        self._head_before = np.zeros(_TIMING_SLOTS, dtype=np.int64)
        self._played = np.zeros(_TIMING_SLOTS, dtype=np.int64)
        self._gen = np.zeros(_TIMING_SLOTS, dtype=np.int64)
        self._slots = 0  # blocks recorded so far
        self._generation = 0  # bumped by start_reply so old blocks are not read as this reply's
        self._first_play_time: float | None = None  # session time the reply's first sample reached the DAC
        self.clock = None  # () -> stream time now; set by AudioIO (None: no latency info)
        # Stream time of session time 0 (the ADC time of the session's first captured sample, set
        # by the session): DAC times minus this are session times, on the clock the microphone's
        # frames are stamped with, so playback_start - user_speech_end is what the user hears.
        self.origin: float | None = None
        self.timing_known = False  # the host API reports DAC times

    # ------------------------------------------------------------ engine side (loop thread)

    @property
    def buffered_samples(self) -> int:
        """Reply samples (model rate) not heard yet: in our buffer, in the resampler, or handed to
        the device but not at the DAC.  The engine waits for 0 before it calls a reply played."""
        with self._lock:
            self._drain_resampler_if_dry()
            in_flight = max(0, self._inner.playhead - self._heard_device_samples())
            return int(round((self._inner.buffered_samples + in_flight) / self._ratio)) + self._rs_pending()

    def release_resampler(self) -> None:
        """Drop the soxr stream (the streams closed).  A soxr object still alive when Python exits
        makes nanobind print a "leaked instances" block: closing lets it go (a new reply makes a
        new one)."""
        with self._lock:
            self._rs = None
            self._rs_in = self._rs_out = 0

    def session_now(self) -> float | None:
        """Session time now, on the stream clock (None before the session set its origin)."""
        clock, origin = self.clock, self.origin
        if clock is None or origin is None:
            return None
        try:
            return clock() - origin
        except Exception:  # noqa: BLE001 - the stream was closed meanwhile
            return None

    @property
    def underruns(self) -> int:
        return self._inner.underruns

    @property
    def playhead(self) -> int:
        """Reply samples (model rate) that reached the DAC by now."""
        with self._lock:
            heard = self._heard_device_samples()
        return int(heard / self._ratio)

    @property
    def reply_first_sample(self) -> int | None:
        """Session-clock sample (model rate) at which the reply's first sample was heard.  The
        session clock counts captured samples (not stream time, which also runs while a backend
        stalls at startup)."""
        t = self._first_play_time
        if t is None:
            return None
        return max(0, int(round(t * self.sample_rate)))

    def start_reply(self) -> None:
        with self._lock:
            self._inner.start_reply()
            self._generation += 1
            self._first_play_time = None

    def end_reply(self) -> None:
        with self._lock:
            self._push_resampler_tail()
            self._inner.end_reply()

    def write(self, samples: np.ndarray) -> bool:
        x = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if x.size == 0:
            return True
        # Room for this chunk plus what the resampler holds back (it may release it now).
        worst = int(math.ceil(x.size * self._ratio)) + self._rs_pending_device() + 64
        if worst > self._inner.capacity:
            raise ValueError(f"chunk of {x.size} samples exceeds the speaker buffer")
        with self._lock:
            if worst > self._inner.free_samples:
                return False
        if self._rs is None:
            self._rs = self._soxr.ResampleStream(self.sample_rate, self.device_rate, 1, dtype="float32", quality="HQ")
        y = self._rs.resample_chunk(x)  # outside the lock: the callback must not wait on this
        with self._lock:
            self._rs_in += x.size
            self._rs_out += y.size
            self._inner.write(y)
        return True

    def pause(self) -> None:
        with self._lock:
            self._inner.pause()

    def resume(self) -> None:
        with self._lock:
            self._inner.resume()

    def flush(self, fade_ms: float | None = None) -> int:
        """Drop all unplayed audio (a short fade plays first); samples already handed to the device
        still play: that is the device's output latency."""
        with self._lock:
            dropped = self._inner.flush(fade_ms)
            self._rs = None  # a fresh filter for the next reply
            self._rs_in = self._rs_out = 0
        return int(round(dropped / self._ratio))

    # ------------------------------------------------------------ internals

    def _rs_pending_device(self) -> int:
        return max(0, int(round(self._rs_in * self._ratio)) - self._rs_out)

    def _rs_pending(self) -> int:
        return int(round(self._rs_pending_device() / self._ratio))

    def _push_resampler_tail(self) -> None:
        if self._rs_in and self._rs is not None:
            tail = self._rs.resample_chunk(np.zeros(0, np.float32), last=True)
            self._inner.write(tail[: self._inner.free_samples])  # a few ms; never more than fits
            self._rs = None
            self._rs_in = self._rs_out = 0

    def _drain_resampler_if_dry(self) -> None:
        # The device ran out while the resampler still holds the last few ms of the reply: no more
        # audio came for a whole buffer, so let the tail out rather than keep it back.
        if self._inner.buffered_samples == 0 and self._rs_pending_device() > 0:
            self._push_resampler_tail()

    def _heard_device_samples(self) -> int:
        inner = self._inner
        clock = self.clock
        if not self.timing_known or clock is None:
            return inner.playhead
        try:
            now = clock()
        except Exception:  # noqa: BLE001 - the stream was closed meanwhile: count what was handed over
            return inner.playhead
        n = min(self._slots, _TIMING_SLOTS)
        for k in range(1, n + 1):  # newest first; stops at the first block already at the DAC
            i = (self._slots - k) % _TIMING_SLOTS
            if self._gen[i] != self._generation:
                break
            if self._dac[i] <= now:
                into = int((now - self._dac[i]) * self.device_rate)
                return int(self._head_before[i] + min(self._played[i], into))
        return 0

    # ------------------------------------------------------------ callback side

    def _render(self, out: np.ndarray, dac_time: float) -> bool:
        """Fill ``out`` (device block) from the buffer; False if the lock stayed busy (out = silence)."""
        if not self._lock.acquire(timeout=LOCK_WAIT_S):
            out[:] = 0.0
            return False
        try:
            inner = self._inner
            before, clock_before, first_before = inner.playhead, inner.clock_samples, inner.reply_first_sample
            inner.tick_into(out)
            i = self._slots % _TIMING_SLOTS
            self._dac[i] = dac_time
            self._head_before[i] = before
            self._played[i] = inner.playhead - before
            self._gen[i] = self._generation
            self._slots += 1
            if first_before is None and inner.reply_first_sample is not None and self.origin is not None:
                # on the session clock: where the reply's first sample reaches the DAC
                self._first_play_time = dac_time - self.origin + (inner.reply_first_sample - clock_before) / self.device_rate
        finally:
            self._lock.release()
        return True


class AudioIO:
    """The microphone and the speaker: an input and an output PortAudio stream at one rate.

    :attr:`speaker` is the engine's; :meth:`read` hands the session what was captured since the
    last call, each block paired with the speaker signal rendered when it arrived (the echo
    canceller's reference: the echo of it arrives later, which the canceller expects).

    Why two streams and not one duplex stream: on ALSA's pulse plugin (the usual Linux path) a
    duplex stream stalls 1-2 s at start while the capture side keeps recording, and half the time
    that backlog stays as permanent input latency (measured: a tone played into the mic reached
    the callback after 1.85 s; with separate streams after 70-90 ms, every time).  One rate and
    one PortAudio clock still tie the two together; WebRTC's echo canceller estimates the
    remaining delay itself.
    """

    def __init__(self, input_device: str | int | None = None, output_device: str | int | None = None,
                 model_out_rate: int = 24000, block_ms: float = DEFAULT_BLOCK_MS, speaker_capacity_s: float = 6.0,
                 rate: int | None = None, latency_s: float = DEFAULT_LATENCY_S, prefer_rates: tuple[int, ...] = ()):
        sd = _sd()
        self.latency = latency_s
        devices = list_devices()
        self.input = resolve_device(input_device, "input", devices)
        self.output = resolve_device(output_device, "output", devices)
        # Mono in; the output gets the mono reply on every channel (some devices refuse mono).
        self.in_channels = 1
        self.out_channels = 1
        try:
            sd.check_output_settings(device=self.output.index, channels=1, dtype="float32",
                                     samplerate=self.output.default_rate)
        except sd.PortAudioError:
            self.out_channels = min(2, self.output.outputs)
        self.rate = rate or choose_rate(self.input, self.output, self.in_channels, self.out_channels, prefer_rates)
        self.block = max(1, int(round(self.rate * block_ms / 1000.0)))
        self.speaker = DeviceSpeaker(self.rate, model_out_rate, block=self.block, capacity_s=speaker_capacity_s)
        size = int(CAPTURE_RING_S * self.rate)
        self._mic_ring = np.zeros(size, np.float32)
        self._ref_ring = np.zeros(size, np.float32)
        self._ring_size = size
        self._written = 0  # capture samples published by the input callback (monotonic)
        self._read = 0  # consumed by read()
        # what the output callback rendered, for pairing with the capture
        self._played_ring = np.zeros(max(4 * self.block, self.rate // 2), np.float32)
        self._played = 0
        self._out_block = np.zeros(self.block, np.float32)
        self.capture_overflows = 0  # blocks dropped because the engine did not read in time
        self.input_overflows = 0  # PortAudio status flags
        self.output_underflows = 0
        self.lock_misses = 0
        self.callbacks = 0  # input callbacks
        self.out_callbacks = 0
        # Per input block (ring, written by the input callback): its first sample's capture index
        # and ADC time (stream time), so that the session stamps frames with when they were heard.
        self._blk_index = np.full(_TIMING_SLOTS, -1, dtype=np.int64)
        self._blk_adc = np.zeros(_TIMING_SLOTS)
        self._out_latency = 0.0  # the output stream's latency: DAC time where the host API gives none
        self.error: str | None = None  # set when a stream stopped on its own
        self._in = self._out = None
        self._closing = False

    def describe(self) -> str:
        return f"{self.input.name} -> {self.output.name} at {self.rate} Hz, {self.block}-sample blocks"

    @property
    def delay_s(self) -> float:
        """Device part of the echo path: output + input latency (the reference is paired when rendered)."""
        lat_in, lat_out = self.latency_s
        return lat_in + lat_out

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        sd = _sd()
        try:
            self._in = sd.InputStream(samplerate=self.rate, blocksize=self.block, device=self.input.index,
                                      channels=self.in_channels, dtype="float32", latency=self.latency,
                                      callback=self._input_callback, finished_callback=self._finished)
            self._out = sd.OutputStream(samplerate=self.rate, blocksize=self.block, device=self.output.index,
                                        channels=self.out_channels, dtype="float32", latency=self.latency,
                                        callback=self._output_callback, finished_callback=self._finished)
            out = self._out
            self.speaker.clock = lambda: out.time
            self._out_latency = float(out.latency)
            self._out.start()
            self._in.start()
            global _open_streams
            _open_streams += 1
            self._counted = True
        except (sd.PortAudioError, ValueError) as e:
            self.close()
            self._closing = False
            raise AudioDeviceError(f"cannot open the microphone {self.input.name!r} and the speaker "
                                   f"{self.output.name!r} at {self.rate} Hz: {e}") from None

    def reopen(self) -> None:
        """Close and open the streams again on the same devices (the retry path); the speaker and
        its buffered reply are kept, the capture ring starts empty."""
        self.close()
        self._closing = False
        self.error = None
        self._written = self._read = 0
        self.callbacks = self.out_callbacks = 0
        self._blk_index[:] = -1
        self.open()

    def close(self) -> None:
        global _open_streams
        if getattr(self, "_counted", False):
            _open_streams -= 1
            self._counted = False
        self._closing = True
        self.speaker.clock = None  # no stream clock: the playhead falls back to what was handed over
        self.speaker.release_resampler()
        for name in ("_in", "_out"):
            stream = getattr(self, name)
            setattr(self, name, None)
            if stream is not None:
                try:
                    stream.abort()
                    stream.close()
                except Exception:  # noqa: BLE001 - the device may already be gone; closing must not raise
                    pass

    @property
    def latency_s(self) -> tuple[float, float]:
        """PortAudio's (input, output) latency of the open streams."""
        lat_in = float(self._in.latency) if self._in is not None else 0.0
        lat_out = float(self._out.latency) if self._out is not None else 0.0
        return (lat_in, lat_out)

    def _finished(self) -> None:
        if not self._closing and self.error is None:
            self.error = (f"the audio stream on {self.input.name!r} / {self.output.name!r} stopped "
                          "(device unplugged or taken by another program?)")

    def fail(self, message: str) -> None:
        """Record a failure noticed outside the callbacks (e.g. no audio for too long)."""
        if self.error is None:
            self.error = message

    # ------------------------------------------------------------ data

    def read(self) -> tuple[np.ndarray, np.ndarray, float | None]:
        """(mic, reference, ADC time of mic[0]) captured since the last call, at the device rate;
        the time is on the stream clock (None when nothing came or its block is no longer known)."""
        w = self._written
        r = self._read
        if w - r <= 0:
            return np.zeros(0, np.float32), np.zeros(0, np.float32), None
        idx = np.arange(r, w) % self._ring_size
        mic, ref = self._mic_ring[idx], self._ref_ring[idx]
        self._read = w
        return mic, ref, self._adc_time(r)

    def _adc_time(self, index: int) -> float | None:
        """ADC time of capture sample ``index``, from the block that holds it."""
        n = min(self.callbacks, _TIMING_SLOTS)
        for k in range(1, n + 1):  # newest first
            i = (self.callbacks - k) % _TIMING_SLOTS
            first = int(self._blk_index[i])
            if 0 <= first <= index:
                return float(self._blk_adc[i]) + (index - first) / self.rate
        return None

    # The two callbacks run on PortAudio's threads: copies and counters only.

    def _output_callback(self, outdata, frames, time, status) -> None:
        if status and status.output_underflow:
            self.output_underflows += 1
        self.out_callbacks += 1
        if self.out_callbacks == 1:
            self.speaker.timing_known = time.outputBufferDacTime > 0
        out = self._out_block if frames == self.block else np.zeros(frames, np.float32)
        dac = time.outputBufferDacTime or time.currentTime + self._out_latency
        if not self.speaker._render(out, dac):
            self.lock_misses += 1
        outdata[:] = out[:, None]
        size = self._played_ring.size
        pos = self._played % size
        first = min(frames, size - pos)
        self._played_ring[pos:pos + first] = out[:first]
        self._played_ring[:frames - first] = out[first:]
        self._played += frames

    def _input_callback(self, indata, frames, time, status) -> None:
        if status and status.input_overflow:
            self.input_overflows += 1
        w = self._written
        if w + frames - self._read > self._ring_size:
            self.capture_overflows += 1
            self._blk_index[self.callbacks % _TIMING_SLOTS] = -1  # dropped: no samples of its own
            self.callbacks += 1
            return
        slot = self.callbacks % _TIMING_SLOTS
        self._blk_index[slot] = w
        self._blk_adc[slot] = time.inputBufferAdcTime or time.currentTime - frames / self.rate
        self.callbacks += 1
        pos = w % self._ring_size
        first = min(frames, self._ring_size - pos)
        self._mic_ring[pos:pos + first] = indata[:first, 0]
        self._mic_ring[:frames - first] = indata[first:, 0]
        # reference: the latest `frames` samples the output rendered
        size = self._played_ring.size
        end = self._played
        if end >= frames:
            self._copy_ref(pos, (end - frames) % size, frames)
        else:
            self._ref_ring[pos:pos + first] = 0.0
            self._ref_ring[:frames - first] = 0.0
        self._written = w + frames  # publish after the copies

    def _copy_ref(self, pos: int, src: int, frames: int) -> None:
        # frames samples from the played ring at src (wrapping) to the ref ring at pos (wrapping)
        size = self._played_ring.size
        done = 0
        while done < frames:
            k = min(frames - done, size - (src + done) % size, self._ring_size - (pos + done) % self._ring_size)
            d, s_ = (pos + done) % self._ring_size, (src + done) % size
            self._ref_ring[d:d + k] = self._played_ring[s_:s_ + k]
            done += k
