"""A scripted conversation (``omnidesk talk``): WAV files into a virtual microphone, the reply
out of a virtual speaker, through the same endpointing and engine as the app.

The microphone plays each input after the previous reply has finished
playing (plus a short gap), paced in real time (or as fast as possible with
``realtime=False``, for tests and benchmarks).  ``barge_in=(seconds, audio)``
mixes ``audio`` into the microphone ``seconds`` after the first reply started
playing.  With ``no_vad`` every input is exactly one turn: it starts at the
file's first sample and ends at its last.  The script stops at the first failed
turn (``engine.failure``), with the timeline of the turns so far (unless
``stop_on_failure`` is off: then the engine drops that turn and the script goes on).

The frame loop (clock, speaker tick, pacing) is :class:`~omnidesk.engine.frames.FrameDriver`'s;
the script here only says which frame comes next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .duplex import DuplexEngine, make_engine, session_rate, vad_rate
from .engine import Engine, EngineConfig
from .executor import Executor, end_session
from .frames import FRAME_S, ClockedSource, FrameDriver, clocked_speaker
from .speaker import VirtualSpeaker
from .timeline import Timeline
from .vad import Endpoint, Endpointer, EndpointerConfig, EnergyVAD, SpeechStart

LEAD_SILENCE_S = 0.3  # before the first input
GAP_S = 0.6  # after a reply finished playing, before the next input
TAIL_S = 0.5  # after the last reply
MAX_WAIT_S = 60.0  # give up waiting for a reply to finish
DUPLEX_TAIL_S = 2.0  # a duplex model never "finishes": after the last input, listen this long


class ScriptedEndpointer(Endpointer):
    """``--no-vad``: turn boundaries are the input files' own boundaries (SpeechStart at a file's
    first frame, Endpoint right after its last), and the utterance is exactly the file."""

    def __init__(self, sample_rate: int = 16000):
        super().__init__(EnergyVAD(), EndpointerConfig(), sample_rate)
        self._utt: list[np.ndarray] = []
        self._active = False
        self._ending = False
        self._begin_t = self._end_t = None

    def begin(self, at: float | None = None) -> None:
        """The file starts with the next frame, or with the frame at session time ``at``: a duplex
        engine's detector hears its copy of the audio a frame late now and then (the resampler's
        bursts), so the script says when."""
        self._utt, self._active, self._ending = [], True, False
        self._begin_t, self._end_t = at, None

    def end(self, at: float | None = None) -> None:
        """The file ended before the next frame (or the frame at session time ``at``)."""
        self._ending, self._end_t = True, at

    def reset(self) -> None:
        self._utt, self._active, self._ending = [], False, False

    @property
    def in_utterance(self) -> bool:
        return self._active

    @property
    def utterance_start_t(self) -> float | None:
        return None  # the utterance is exactly the file: nothing to trim

    def utterance_audio(self) -> np.ndarray:
        return np.concatenate(self._utt) if self._utt else np.zeros(0, np.float32)

    def new_audio_since(self, start: int) -> np.ndarray:
        return self.utterance_audio()[start:]

    @property
    def committed_samples(self) -> int:
        return sum(f.size for f in self._utt)

    def push(self, frame: np.ndarray, t: float):
        events = []
        if not self._active or (self._begin_t is not None and t < self._begin_t - 1e-9):
            return events
        ending = self._ending and (self._end_t is None or t >= self._end_t - 1e-9)
        if not self._utt and not ending:
            events.append(SpeechStart(t, t))
        if ending:
            events.append(Endpoint(t, t))
            self._active = False
            return events
        self._utt.append(np.asarray(frame, np.float32))
        return events


@dataclass
class Script:
    inputs: list[np.ndarray]  # mono float32 utterances at the executor's input rate (session_rate)
    barge_in: tuple[float, np.ndarray] | None = None
    no_vad: bool = False
    interrupt_after_s: float | None = None  # the stop button, this long into the first reply
    stop_on_failure: bool = True  # False: a failed turn is dropped and the script goes on (as the app does)


class _ScriptedMic(ClockedSource):
    """The script's microphone: its frames (the script proper, :func:`_script_frames`) with the
    barge-in mixed in; the run stops at the first failed turn when the script says so."""

    def __init__(self, frames: Iterator[np.ndarray], driver: FrameDriver, script: Script, timeline: Timeline,
                 engine: Engine | DuplexEngine):
        self.frames, self.driver, self.script, self.timeline, self.engine = frames, driver, script, timeline, engine
        self.overlay = None  # (start sample on the mic clock, audio)

    async def next_frame(self, t: float) -> np.ndarray | None:
        frame = next(self.frames, None)
        if frame is None:
            return None
        barge_in = self.script.barge_in
        if barge_in is not None and self.overlay is None:
            turns = self.timeline.turns
            first = turns[0].events["playback_start"] if turns else None
            if first is not None:
                self.overlay = (int(round((first + barge_in[0]) * self.driver.rate)), barge_in[1])
        if self.overlay is not None:
            lo = self.driver.sample - self.overlay[0]
            if lo + frame.size > 0 and lo < self.overlay[1].size:
                seg = self.overlay[1][max(0, lo):lo + frame.size]
                frame = frame.copy()
                frame[max(0, -lo):max(0, -lo) + seg.size] += seg
        return frame

    def heard(self, frame: np.ndarray) -> bool:
        # the caller reports engine.failure; the timeline holds the turns so far
        return self.engine.failure is None or not self.script.stop_on_failure


def _script_frames(script: Script, driver: FrameDriver, engine: Engine | DuplexEngine, endpointer: Endpointer,
                   timeline: Timeline, duplex: bool) -> Iterator[np.ndarray]:
    """The script as microphone frames.  The driver takes each when the one before has been heard
    (and paced), so ``driver.t`` and ``engine.idle`` here are as of that moment."""
    rate_in, frame_in = driver.rate, driver.frame_samples
    silence = np.zeros(frame_in, np.float32)

    def wait_idle(extra_s: float) -> Iterator[np.ndarray]:
        waited = 0.0
        # a duplex model talks when it likes (a random demo all the time): the script only paces it
        while not duplex and not engine.idle and waited < MAX_WAIT_S:
            yield silence
            waited += FRAME_S
        for _ in range(int(round(extra_s / FRAME_S))):
            yield silence

    for _ in range(int(round(LEAD_SILENCE_S / FRAME_S))):
        yield silence
    # Where each input was played on the session clock: a turn belongs to the input its speech
    # started in (bench/turn_taking.py maps labelled files to turns with it).
    played = timeline.extra.setdefault("inputs", [])
    for utterance in script.inputs:
        t = driver.t
        if script.no_vad:
            endpointer.begin(t)
        played.append({"start_s": round(t, 6), "end_s": round(t + utterance.size / rate_in, 6)})
        padded = np.concatenate([utterance, np.zeros((-utterance.size) % frame_in, np.float32)])
        for i in range(0, padded.size, frame_in):
            yield padded[i:i + frame_in]
        if script.no_vad:
            endpointer.end(driver.t)
            yield silence
        yield from wait_idle(GAP_S)
    # let a late barge-in happen, then let its reply finish
    if script.barge_in is not None:
        yield from wait_idle(TAIL_S)
    yield from wait_idle(DUPLEX_TAIL_S if duplex else TAIL_S)


async def run_script(executor: Executor, script: Script, config: EngineConfig, timeline: Timeline,
                     realtime: bool = True, endpointer_config: EndpointerConfig | None = None,
                     on_update=None, detector=None, judge=None,
                     held: dict | None = None) -> tuple[Engine | DuplexEngine, VirtualSpeaker]:
    """``detector``: the per-frame speech detector (``omnidesk talk`` passes webrtcvad; the
    default, an energy threshold, suits synthetic test signals).  ``judge``: an end-of-turn judge
    (:mod:`omnidesk.engine.turn_judge`; None: the fixed silence rule); the caller closes it.
    ``held`` gets the engine and the speaker as soon as they exist, so a caller whose run is cut short
    (Ctrl-C) can still write what was played and the turns so far."""
    rate_in = session_rate(executor)  # the microphone: what the model hears, as it hears it
    duplex = getattr(executor, "duplex", False)
    speaker = clocked_speaker(executor.sample_rate_out, config.max_audio_ahead_s + 2.0)
    vad = vad_rate(executor)  # a duplex engine makes the detector's copy itself
    endpointer = ScriptedEndpointer(vad) if script.no_vad else \
        Endpointer(detector or EnergyVAD(), endpointer_config or EndpointerConfig(), vad, judge=judge)
    engine = make_engine(executor, endpointer, speaker, config, timeline, on_update)
    engine.interrupt_after_s = script.interrupt_after_s
    if held is not None:
        held.update(engine=engine, speaker=speaker)
    # a late frame follows the one before at once, as a device's burst would
    driver = FrameDriver(engine, rate_in, speaker, realtime=realtime, yield_when_late=False)
    frames = _script_frames(script, driver, engine, endpointer, timeline, duplex)
    try:
        await driver.run(_ScriptedMic(frames, driver, script, timeline, engine))
    finally:
        await engine.aclose()
        engine.close()
        end_session(executor)  # a remote executor stops streaming a reply cut short (Ctrl-C)
    return engine, speaker


LATENCY_HEADER = ("turn  end->endpoint  endpoint->1st audio  endpoint->playing  voice-to-voice  text  codes  "
                  "reply s  played s  interrupted")


def latency_row(number: int, turn) -> str:
    """One turn's line of :func:`latency_table` (ms, on the session clock)."""

    def ms(a, b):
        return "-" if a is None or b is None else f"{(b - a) * 1000:6.0f}"

    ev = turn.events
    cut = "-"
    error = turn.extra.get("error")
    if error:
        cut = f"FAILED in the {error['stage']}"
    elif turn.interrupted:
        b = turn.barge_in
        cut = f"yes: kept {b.kept_text_tokens} tok, rolled back {b.rolled_back_tokens}"
    if (turn.extra.get("end_of_turn") or {}).get("ended_by") == "length":  # the user went on speaking
        cut = ("" if cut == "-" else cut + "; ") + "your turn was cut at the utterance limit (it went on in the next)"
    return (f"{number:4d}  {ms(turn.user_speech_end, turn.endpoint):>13}  "
            f"{ms(turn.endpoint, ev['first_audio_chunk']):>19}  {ms(turn.endpoint, ev['playback_start']):>17}  "
            f"{ms(turn.user_speech_end, ev['playback_start']):>14}  {len(turn.text_token_ids):4d}  "
            f"{len(turn.codec_token_ids):5d}  {turn.reply_audio_s:7.2f}  {turn.played_audio_s:8.2f}  {cut}")


def latency_table(timeline: Timeline) -> str:
    """One line per turn: where the time went (ms, on the session clock)."""
    return "\n".join([LATENCY_HEADER] + [latency_row(i + 1, t) for i, t in enumerate(timeline.turns)])
