"""Speech detection and endpointing on 16 kHz float32 mono microphone frames.

Two layers:

* a :class:`SpeechDetector` says whether one frame holds speech
  (:class:`EnergyVAD` here; a webrtcvad-backed one plugs in with the same
  ``is_speech`` method);
* the :class:`Endpointer` turns that per-frame decision into turn events and
  keeps the utterance audio.

Events, in the order one utterance produces them::

    SpeechOnset -> (OnsetCancelled | SpeechStart) -> [Pause -> Resume]* -> Pause -> Endpoint

``SpeechOnset``/``OnsetCancelled`` let the engine duck playback on the first
speech frame of a barge-in and un-duck after a cough (the SUSPECTED_BARGE_IN
state of ARCHITECTURE.md); ``Pause`` is where PREEMPTING starts; ``Endpoint``
ends the turn.  A forced endpoint (``max_utterance_s``) comes without a Pause.

End of turn.  Without a judge the turn ends after ``endpoint_silence_ms`` of
silence (the fixed rule).  With a :class:`TurnJudge` (a semantic end-of-turn
model, :mod:`omnidesk.engine.turn_judge`) each pause is scored once it reaches
``turn_min_silence_ms``, and, while the verdict is "unsure", re-scored every
``turn_rescore_ms`` as it grows; every verdict is a ``TurnScore`` event:

* ``p_complete >= turn_complete``: the user is done, ``Endpoint`` now;
* ``p_complete <= turn_incomplete``: a mid-sentence pause, wait out
  ``turn_max_wait_ms`` of silence, with no more scores.  The model drifts
  towards "complete" as a pause grows past what it was trained on: on the
  recorded human turns (shared/data/turns-human) every pause whose "not
  finished" was later overturned by a "complete" re-score was a cut-off
  sentence (3 of 3, ended 0.5-1.1 s after the speech: cut-ins), and no finished
  sentence was first judged "not finished";
* in between: the fixed rule decides.

A score still being computed when the fixed rule's silence is reached holds the
endpoint until its verdict lands (at most ``turn_max_wait_ms``).  A score takes
~50 ms of CPU, several times that on a busy machine, and ending the turn under
it let the rule answer where the model, a few frames later, said "not
finished" (bench/live_latency.py, one core busy: the two questions the model
waits out when idle, and in ``talk --fast``, which scores inline, were
answered by the rule ~500 ms after they ended).

Scores are computed by the judge on its own thread (never the audio thread,
never the model's worker); a verdict lands on the first frame after it is
ready.  Speech resuming drops any verdict of the pause.

Times are whatever clock the caller passes to :meth:`Endpointer.push` (the
session monotonic clock); the endpointer assumes frames are contiguous.
Nothing here uses threads; every call does O(frame) work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Union

import numpy as np

SAMPLE_RATE = 16000
# Below this RMS a frame is treated as digital silence; keeps log10 finite.
_RMS_FLOOR = 1e-10


class SpeechDetector(Protocol):
    """Per-frame speech/non-speech decision on float32 mono frames in [-1, 1]."""

    def is_speech(self, frame: np.ndarray) -> bool: ...


def level_dbfs(frame: np.ndarray) -> float:
    """RMS level of ``frame`` in dBFS (full scale = 1.0; a full-scale sine is -3 dBFS)."""
    x = np.asarray(frame, dtype=np.float32)
    if x.size == 0:
        return 20.0 * math.log10(_RMS_FLOOR)
    rms = math.sqrt(float(np.dot(x, x)) / x.size)
    return 20.0 * math.log10(max(rms, _RMS_FLOOR))


@dataclass
class EnergyVADConfig:
    # Quiet rooms sit around -60..-50 dBFS on a laptop mic, normal speech at
    # -30..-15 dBFS; -40 separates them without a noise model.
    threshold_dbfs: float = -40.0


class EnergyVAD:
    """Dependency-free detector: a frame is speech when its RMS is at least the threshold.

    Stateless; good enough for scripted input and tests.  It cannot tell
    speech from other loud sound (music, the assistant's own echo).
    """

    def __init__(self, config: EnergyVADConfig | None = None):
        self.config = config or EnergyVADConfig()
        # Compare mean squares instead of taking a log per frame.
        self._threshold_ms = (10.0 ** (self.config.threshold_dbfs / 20.0)) ** 2

    def is_speech(self, frame: np.ndarray) -> bool:
        x = np.asarray(frame, dtype=np.float32).reshape(-1)
        if x.size == 0:
            return False
        return float(np.dot(x, x)) / x.size >= self._threshold_ms


# --------------------------------------------------------------------- events


@dataclass(frozen=True)
class SpeechOnset:
    """First speech frame of a run that is not yet long enough to start a turn (``t`` = its start)."""

    t: float


@dataclass(frozen=True)
class OnsetCancelled:
    """The run that began at ``t_onset`` ended before ``speech_start_ms`` (a cough, a click); ``t`` = when."""

    t_onset: float
    t: float


@dataclass(frozen=True)
class SpeechStart:
    """A turn started.  ``t`` is back-dated to the first speech frame of the confirming run;
    ``t_confirmed`` is the end of the frame that confirmed it (when the caller learnt it)."""

    t: float
    t_confirmed: float


@dataclass(frozen=True)
class Pause:
    """Silence reached ``preempt_silence_ms``; ``t_speech_end`` = end of the last speech frame."""

    t_speech_end: float


@dataclass(frozen=True)
class Resume:
    """Speech came back after a Pause, before the endpoint; ``t`` = start of that speech frame."""

    t: float


@dataclass(frozen=True)
class Endpoint:
    """The turn ended.  ``t_endpoint`` = end of the frame that completed the silence (or hit the
    length limit); ``t_speech_end`` = where the voice stopped, found in the audio of the last
    speech frames (the detector holds "speech" past it; see ``speech_end_search_ms``).  ``forced`` = ended by ``max_utterance_s`` (no Pause precedes it then)."""

    t_endpoint: float
    t_speech_end: float
    forced: bool = False
    by: str = "silence"  # what ended it: "silence" (the fixed rule or a waited-out pause), "model", "length"


@dataclass(frozen=True)
class TurnScore:
    """The end-of-turn model's verdict on a pause.  ``t`` = end of the frame it arrived in;
    ``silence_ms`` = the pause length in the scored audio; ``decision`` is "complete",
    "incomplete" or "unsure" (the fixed rule decides); ``cpu_ms`` = the model's compute time."""

    t: float
    t_speech_end: float
    silence_ms: float
    p_complete: float
    decision: str
    cpu_ms: float


class TurnJudge(Protocol):
    """Scores whether the user has finished their turn (see :mod:`omnidesk.engine.turn_judge`).

    ``submit`` hands it the utterance so far (16 kHz); ``poll`` returns the (p_complete, cpu_ms)
    of the last submission once it is ready, and None before (and after a ``discard``)."""

    name: str
    window_s: float  # how much of the utterance's end it looks at

    @property
    def pending(self) -> bool:
        """A submission whose verdict ``poll`` has not handed out yet (computing, or just ready)."""

    def submit(self, audio: np.ndarray) -> None: ...

    def poll(self) -> tuple[float, float] | None: ...

    def score_after(self, event) -> None:
        """The engine's hint: a speculative reply is making its first chunk and sets the
        ``threading.Event`` once it is made (or the reply stopped); a judge may hold its scores
        until then (SmartTurnJudge does where no core is spare for both)."""

    def discard(self) -> None: ...


EndpointerEvent = Union[SpeechOnset, OnsetCancelled, SpeechStart, Pause, Resume, TurnScore, Endpoint]


# --------------------------------------------------------------------- config


@dataclass
class EndpointerConfig:
    frame_ms: float = 40.0  # nominal (and largest accepted) frame length
    speech_start_ms: float = 120.0  # consecutive speech needed to start a turn
    # While the assistant speaks, a run must be this long to count as a barge-in: long enough
    # that a cough, an "mm-hm" or a door does not cut the reply off (playback is only paused
    # meanwhile, from the onset on).
    barge_in_start_ms: float = 300.0
    # While the assistant speaks, non-speech frames a run may hold before it is cancelled.  One
    # frame of the user's voice lost under the echo (double talk: the canceller suppresses it for
    # a frame) or a gap between words otherwise resumed playback mid-interruption, and the next
    # frame paused it again: loud stutter, and the barge-in confirmed hundreds of ms late.
    barge_in_gap_ms: float = 80.0
    # Speech detectors hold "speech" on for a while after the voice stops (WebRTC VAD's hangover,
    # and a 40 ms frame counts as speech if either half is): on the recorded human turns the last
    # speech frame ended up to 150 ms after the labelled end (median 85 ms), live behind the echo
    # canceller ~160 ms.  So when a pause starts the speech end is looked for again in the audio,
    # back to this far before the detector's: the end of the last 10 ms block still within
    # ``speech_end_drop_db`` of the utterance's speech level (and 6 dB over its background).  That
    # is the turn's user_speech_end (where voice-to-voice starts: the user stopped then), and the
    # speculative reply's pause (preempt_silence_ms) counts from it.  The endpoint and the
    # end-of-turn judge's pauses still count from the detector's last speech frame: counted from
    # the voice's end, 400 ms cut into 9 of the 30 human turns mid-sentence instead of 4.
    # 0 turns the search off (the detector's frame end, as before).
    speech_end_search_ms: float = 240.0
    speech_end_drop_db: float = 30.0
    # Silence after the voice's end (searched, above) at which a reply is generated speculatively,
    # held until the endpoint.  In practice it fires on the detector's first or second non-speech
    # frame: the detector holds ~85 ms past the voice, so 100 ms is reached on the first silent
    # frame of nearly every pause, 150 ms only on the second.  On the recorded human turns
    # (shared/data/turns-human, webrtcvad, no judge) 100 instead of 150 starts the final pause's
    # reply 43 ms sooner (median 132 vs 175 ms after the labelled speech end) for 27 instead of 25
    # speculative starts thrown away inside the 30 turns (below 80 ms: 29, at 40: 50).  Those ms
    # count with an end-of-turn judge: its first score (turn_min_silence_ms, two frames later) and
    # the reply's first audio are what the endpoint waits for, and on a busy CPU the two share a
    # core; the sooner the reply starts, the less its first chunk overlaps the score
    # (bench/live_latency.py).  With the fixed rule the reply is ready long before the endpoint.
    preempt_silence_ms: float = 100.0
    endpoint_silence_ms: float = 400.0  # silence that ends the turn (after the detector's last speech frame)
    pre_roll_ms: float = 200.0  # audio kept before the first speech frame (soft onsets)
    max_utterance_s: float = 30.0  # speech start to forced endpoint
    # With an end-of-turn judge (see the module docstring); its pauses count from the detector's
    # last speech frame, like the fixed rule's.  On recorded human speech
    # (shared/data/turns-human, bench/turn_taking.py --set) counting them from the voice's end
    # instead scored comma pauses inside sentences sooner and cut in on 6-9 of the 30 turns
    # mid-sentence instead of 3 (the model is as sure at a comma, 0.85-0.99, as at a full stop);
    # thresholds from 0.7 / 0.3 to 0.9 / 0.5 gave the same cut-ins there.
    # The pause length at which it is first scored.  Smart Turn's score hardly moves as a pause
    # grows: on the recorded human turns it moved by at most 0.1 between 80 and 400 ms of silence
    # on 23 of the 29 final pauses, so waiting longer adds latency, not information.  What guards against
    # word gaps is the pause length itself: 120 ms after the detector's last speech frame is about
    # 200 ms after the voice (the detector holds ~85 ms), longer than the gaps between words of
    # fluent speech.  Measured there (bench/turn_taking.py --set): 160 ms -> endpoint median 278 ms,
    # 4 mid-sentence cut-ins; 120 ms -> 238 ms, 5 (one 120-160 ms comma pause).  At 80 ms gaps
    # between words get scored too (two inside sentences there, one at 0.79).
    turn_min_silence_ms: float = 120.0
    turn_rescore_ms: float = 200.0  # how much longer the pause grows before it is scored again
    turn_complete: float = 0.7  # p_complete at or above: the turn ends now
    turn_incomplete: float = 0.3  # p_complete at or below: wait up to turn_max_wait_ms
    turn_max_wait_ms: float = 1500.0  # the longest pause a "not finished" verdict waits out

    def __post_init__(self):
        if self.frame_ms <= 0:
            raise ValueError("frame_ms must be > 0")
        for name in ("speech_start_ms", "barge_in_start_ms", "barge_in_gap_ms", "preempt_silence_ms",
                     "endpoint_silence_ms", "pre_roll_ms", "speech_end_search_ms", "speech_end_drop_db"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.preempt_silence_ms > self.endpoint_silence_ms:
            # The state machine goes USER_SPEAKING -> PREEMPTING -> RESPONDING; a
            # Pause after the Endpoint would make no sense.
            raise ValueError("preempt_silence_ms must be <= endpoint_silence_ms")
        if self.max_utterance_s <= 0:
            raise ValueError("max_utterance_s must be > 0")
        if not 0.0 <= self.turn_incomplete <= self.turn_complete <= 1.0:
            raise ValueError("need 0 <= turn_incomplete <= turn_complete <= 1")
        if self.turn_max_wait_ms < self.endpoint_silence_ms:
            raise ValueError("turn_max_wait_ms must be >= endpoint_silence_ms")


# ----------------------------------------------------------------- endpointer

IDLE = "idle"  # waiting for speech (candidate runs are tracked here)
SPEAKING = "speaking"  # inside an utterance (paused or not)
ENDED = "ended"  # Endpoint emitted; waiting for reset()


class _PreRoll:
    """Fixed ring of the most recent samples (the audio before a speech start)."""

    def __init__(self, capacity: int):
        self.buf = np.zeros(max(capacity, 1), dtype=np.float32)
        self.pos = 0  # next write index
        self.filled = 0

    def push(self, x: np.ndarray) -> None:
        cap = self.buf.size
        if x.size >= cap:
            x = x[-cap:]
        n = x.size
        first = min(n, cap - self.pos)
        self.buf[self.pos : self.pos + first] = x[:first]
        self.buf[: n - first] = x[first:]
        self.pos = (self.pos + n) % cap
        self.filled = min(cap, self.filled + n)

    def last(self, n: int) -> np.ndarray:
        n = min(n, self.filled)
        idx = (np.arange(self.pos - n, self.pos)) % self.buf.size
        return self.buf[idx]


class Endpointer:
    """Turns per-frame speech decisions into turn events and collects the utterance audio.

    Feed every microphone frame, in order, with :meth:`push`.  State:

    * IDLE: frames go to a pre-roll ring only.  A speech frame opens a
      candidate run (``SpeechOnset``); ``speech_start_ms`` (``barge_in_start_ms`` while
      :attr:`assistant_speaking`) of consecutive speech
      confirms it (``SpeechStart``, back-dated to the run's first frame) and
      the utterance buffer is seeded with the pre-roll plus the run.  A silent
      frame before that cancels the run (``OnsetCancelled``); while the
      assistant speaks, silence longer than ``barge_in_gap_ms`` does.
    * SPEAKING: every frame is appended to the utterance.  Silence of
      ``preempt_silence_ms`` emits ``Pause``, speech after it ``Resume``,
      silence of ``endpoint_silence_ms`` (or ``max_utterance_s`` of utterance)
      emits ``Endpoint``.
    * ENDED: the utterance is frozen (still readable); frames only feed the
      pre-roll.  Call :meth:`reset` to listen for the next turn.

    Memory: the pre-roll ring is fixed; the utterance buffer grows by doubling
    during an utterance (at most ``pre_roll + max_utterance`` plus one frame)
    and is reused, not freed, by :meth:`reset`.
    """

    def __init__(self, detector: SpeechDetector, config: EndpointerConfig | None = None,
                 sample_rate: int = SAMPLE_RATE, judge: TurnJudge | None = None):
        self.detector = detector
        self.judge = judge
        self.config = config = config or EndpointerConfig()
        self.sample_rate = sample_rate
        ms = sample_rate / 1000.0
        self.frame_samples = max(1, round(config.frame_ms * ms))
        self._speech_start_samples = round(config.speech_start_ms * ms)
        self._barge_in_samples = round(config.barge_in_start_ms * ms)
        self._barge_in_gap_samples = round(config.barge_in_gap_ms * ms)
        # Set by the engine while a reply plays: runs then need barge_in_start_ms to start a turn.
        self.assistant_speaking = False
        self._preempt_samples = round(config.preempt_silence_ms * ms)
        self._endpoint_samples = round(config.endpoint_silence_ms * ms)
        self._pre_roll_samples = round(config.pre_roll_ms * ms)
        self._max_samples = round(config.max_utterance_s * sample_rate)
        self._turn_min_samples = round(config.turn_min_silence_ms * ms)
        self._turn_rescore_samples = max(1, round(config.turn_rescore_ms * ms))
        self._turn_max_samples = round(config.turn_max_wait_ms * ms)
        # A confirming run is at most speech_start + one frame long; the ring
        # must hold it plus the pre-roll before it.
        longest_run = max(self._speech_start_samples, self._barge_in_samples + self._barge_in_gap_samples)
        self._ring = _PreRoll(self._pre_roll_samples + longest_run + self.frame_samples)
        self._utt = np.zeros(0, dtype=np.float32)
        self.reset()

    # ------------------------------------------------------------ state

    def reset(self) -> None:
        """Forget the current utterance and listen for the next turn.

        The pre-roll ring is kept: it is real recent audio, so a turn that
        starts right after the reset still gets its pre-roll."""
        self.state = IDLE
        self._utt_len = 0
        self._pre_roll_len = 0
        self._run_start: float | None = None  # IDLE: start of the candidate speech run
        self._run_samples = 0  # its speech samples
        self._run_span = 0  # its samples, gaps included (barge-in runs may hold short gaps)
        self._run_gap = 0  # non-speech samples since its last speech frame
        self.speech_start_t: float | None = None
        self._paused = False
        self._silence_samples = 0  # since the detector's last speech frame
        self._voice_gap = 0  # samples between the voice's end and that frame's end (this pause)
        self._speech_samples = 0  # utterance samples after the pre-roll (for max_utterance)
        self._last_speech_end: float | None = None
        self._forget_verdict()

    def _forget_verdict(self) -> None:
        """A new pause (or turn): no verdict yet, and a score still being computed is dropped."""
        self._verdict: str | None = None
        self._scored_silence: int | None = None  # silence samples in the audio last submitted
        if self.judge is not None:
            self.judge.discard()

    @property
    def in_utterance(self) -> bool:
        return self.state == SPEAKING

    @property
    def committed_samples(self) -> int:
        """Utterance samples the turn will certainly hold: all but the trailing silence beyond
        ``preempt_silence_ms`` (kept only if speech resumes).  Feeding the model exactly these
        makes a reply independent of whether it was started preemptively or at the endpoint."""
        quiet = self._silence_samples + self._voice_gap
        trailing = max(0, quiet - self._preempt_samples) if self.state != IDLE else 0
        return max(0, self._utt_len - trailing)

    @property
    def paused(self) -> bool:
        """Inside an utterance and a Pause was emitted with no Resume since."""
        return self.state == SPEAKING and self._paused

    @property
    def utterance_samples(self) -> int:
        """Samples in the utterance buffer so far (pre-roll included)."""
        return self._utt_len

    @property
    def pre_roll_samples(self) -> int:
        """How many samples at the head of the utterance precede the first speech frame."""
        return self._pre_roll_len

    @property
    def utterance_start_t(self) -> float | None:
        """Session time of ``utterance_audio()[0]`` (None outside an utterance)."""
        if self.speech_start_t is None:
            return None
        return self.speech_start_t - self._pre_roll_len / self.sample_rate

    def utterance_audio(self) -> np.ndarray:
        """Pre-roll + everything from speech start to the last pushed frame (a copy).

        Trailing silence up to the current frame is included; trim with
        ``Endpoint.t_speech_end`` and :attr:`utterance_start_t` if needed."""
        return self._utt[: self._utt_len].copy()

    def new_audio_since(self, start: int) -> np.ndarray:
        """Utterance samples from index ``start`` on (a copy), for taking finished encoder
        blocks while the user is still speaking: keep your own cursor, e.g.
        ``while ep.utterance_samples - cur >= block: x = ep.new_audio_since(cur)[:block]; cur += block``."""
        if start < 0:
            raise ValueError("start must be >= 0")
        return self._utt[min(start, self._utt_len) : self._utt_len].copy()

    # ------------------------------------------------------------- push

    def push(self, frame: np.ndarray, t: float) -> list[EndpointerEvent]:
        """Process one frame that starts at session time ``t``; return the events it caused.

        ``frame`` is float32 mono at ``sample_rate``, at most ``frame_ms`` long
        (a shorter last frame is fine)."""
        x = np.asarray(frame, dtype=np.float32).reshape(-1)
        n = x.size
        if n > self.frame_samples:
            raise ValueError(f"frame of {n} samples is longer than frame_ms ({self.frame_samples} samples)")
        t_end = t + n / self.sample_rate
        self._ring.push(x)
        if self.state == ENDED or n == 0:
            return []
        speech = bool(self.detector.is_speech(x))
        if self.state == IDLE:
            return self._push_idle(speech, n, t, t_end)
        return self._push_speaking(x, speech, t, t_end)

    def _push_idle(self, speech: bool, n: int, t: float, t_end: float) -> list[EndpointerEvent]:
        events: list[EndpointerEvent] = []
        if not speech:
            if self._run_start is not None:
                self._run_gap += n
                self._run_span += n
                if not self.assistant_speaking or self._run_gap > self._barge_in_gap_samples:
                    events.append(OnsetCancelled(self._run_start, t))
                    self._run_start, self._run_samples = None, 0
            return events
        if self._run_start is None:
            self._run_start, self._run_samples, self._run_span = t, 0, 0
            events.append(SpeechOnset(t))
        self._run_samples += n
        self._run_span += n
        self._run_gap = 0
        needed = self._barge_in_samples if self.assistant_speaking else self._speech_start_samples
        if self._run_samples < needed:
            return events
        # Confirmed: seed the utterance with pre-roll + the whole run (both in the ring).
        seed = self._ring.last(self._pre_roll_samples + self._run_span)
        self._utt_len = 0
        self._append(seed)
        self._pre_roll_len = seed.size - min(self._run_span, seed.size)
        self._speech_samples = self._run_span
        self.speech_start_t = self._run_start
        self._last_speech_end = t_end
        self.state = SPEAKING
        self._run_start, self._run_samples = None, 0
        events.append(SpeechStart(self.speech_start_t, t_end))
        return self._check_max(events, t_end)

    def _push_speaking(self, x: np.ndarray, speech: bool, t: float, t_end: float) -> list[EndpointerEvent]:
        events: list[EndpointerEvent] = []
        self._append(x)
        self._speech_samples += x.size
        if speech:
            if self._paused:
                events.append(Resume(t))
                self._paused = False
            if self._silence_samples:
                self._forget_verdict()
            self._silence_samples = self._voice_gap = 0
            self._last_speech_end = t_end
        else:
            if self._silence_samples == 0:  # the pause starts: where did the voice really stop?
                self._voice_gap = self._voice_stopped_before(x.size)
                self._last_speech_end -= self._voice_gap / self.sample_rate
            self._silence_samples += x.size
            if not self._paused and self._silence_samples + self._voice_gap >= self._preempt_samples:
                self._paused = True
                events.append(Pause(self._last_speech_end))
            if self.judge is not None and self._judge_pause(events, t_end):
                events.append(Endpoint(t_end, self._last_speech_end, by="model"))
                self.state = ENDED
                return events
            # a verdict in flight holds the fixed rule (see the module docstring)
            held = self._verdict == "incomplete" or (self.judge is not None and self.judge.pending)
            wait = self._turn_max_samples if held else self._endpoint_samples
            if self._silence_samples >= wait:
                events.append(Endpoint(t_end, self._last_speech_end))
                self.state = ENDED
                return events
        return self._check_max(events, t_end)

    def _voice_stopped_before(self, appended: int) -> int:
        """Samples between the end of the voice and the end of the last speech frame (see
        ``EndpointerConfig.speech_end_search_ms``): 0 when the voice lasts to the frame's end."""
        search = round(self.config.speech_end_search_ms * self.sample_rate / 1000.0)
        block = max(1, self.sample_rate // 100)  # 10 ms
        end = self._utt_len - appended  # the last speech frame's end (the current frame is appended)
        if search < block or end < 4 * block:
            return 0
        power = np.square(self._utt[end % block:end].reshape(-1, block)).mean(axis=1)
        level = 10.0 * np.log10(power + 1e-12)
        speech = np.percentile(level, 90)  # the utterance's speech level (its louder blocks)
        background = np.percentile(level, 10)  # between words and in the pre-roll
        threshold = max(speech - self.config.speech_end_drop_db, background + 6.0)
        tail = level[-(search // block):]
        loud = np.flatnonzero(tail >= threshold)
        last = int(loud[-1]) + 1 if loud.size else 0
        return (tail.size - last) * block

    def _judge_pause(self, events: list[EndpointerEvent], t_end: float) -> bool:
        """Score the pause when due and apply a verdict that is ready; True: the turn is complete."""
        judge, silence = self.judge, self._silence_samples
        if self._verdict == "incomplete":
            return False  # "not finished" holds for the rest of the pause: no more scores (see the docstring)
        if not judge.pending and silence >= self._turn_min_samples and (
                self._scored_silence is None or silence - self._scored_silence >= self._turn_rescore_samples):
            self._scored_silence = silence
            start = max(0, self._utt_len - round(judge.window_s * self.sample_rate))
            judge.submit(self._utt[start: self._utt_len].copy())  # the buffer is reused: hand over a copy
        ready = judge.poll()
        if ready is None:
            return False
        p, cpu_ms = ready
        cfg = self.config
        verdict = "complete" if p >= cfg.turn_complete else "incomplete" if p <= cfg.turn_incomplete else "unsure"
        self._verdict = verdict
        events.append(TurnScore(t=t_end, t_speech_end=self._last_speech_end,
                                silence_ms=self._scored_silence * 1000.0 / self.sample_rate, p_complete=p,
                                decision=self._verdict, cpu_ms=cpu_ms))
        return self._verdict == "complete"

    def _check_max(self, events: list[EndpointerEvent], t_end: float) -> list[EndpointerEvent]:
        if self.state == SPEAKING and self._speech_samples >= self._max_samples:
            events.append(Endpoint(t_end, self._last_speech_end, forced=True, by="length"))
            self.state = ENDED
        return events

    def _append(self, x: np.ndarray) -> None:
        need = self._utt_len + x.size
        if need > self._utt.size:
            # Doubling keeps appends amortised O(frame); the cap is the longest
            # possible utterance, so memory stays bounded.
            cap_limit = self._pre_roll_samples + self._max_samples + 2 * self.frame_samples
            new_size = max(need, min(max(2 * self._utt.size, 16 * self.frame_samples), cap_limit))
            grown = np.zeros(new_size, dtype=np.float32)
            grown[: self._utt_len] = self._utt[: self._utt_len]
            self._utt = grown
        self._utt[self._utt_len : need] = x
        self._utt_len = need
