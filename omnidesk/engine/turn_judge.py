"""The end-of-turn judge: a semantic end-of-turn model scored off the audio and model threads.

The :class:`~omnidesk.engine.vad.Endpointer` asks at each pause whether the
user has finished (see its module docstring for the policy).  The model is
Smart Turn v3 (:mod:`omnidesk.engine.smart_turn`, optional: onnxruntime plus
the model file from the pipecat-ai wheel).  It runs on one thread of its own,
at a lower CPU priority (:data:`JUDGE_NICE`): the audio callback only copies, the
model's worker only steps the model, so a score (tens of milliseconds on a CPU)
never delays either.  In a paced run
that is not real time (``omnidesk talk --fast``) the judge scores inline
instead (``blocking``), so the verdict lands at the same session time as it
would live with an instant model, and a run is reproducible.

:func:`make_judge` picks it from the user's setting: "smart" (required),
"fixed" (none: the fixed silence rule), "auto" (smart when installed).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np

from .cpu_priority import CoreMeter, lower_this_thread

log = logging.getLogger("omnidesk.engine")

END_OF_TURN_CHOICES = ("auto", "smart", "fixed")

# The scoring thread runs at nice +5 (Linux, that thread only).  At a pause the score (~38 ms of
# CPU on the 2-core dev machine) and the demo's first reply chunk (78-87 ms) are both what the
# endpoint waits for.  A priority only orders what shares a core, and nice +5 or +10 still let the
# score stretch the first chunk on a busy machine (reply_pipeline.py holds the reply after its
# first chunk until the verdict, but a score that began earlier already took its share).  So where
# the rest of the machine leaves less than SIDE_BY_SIDE_CORES (cpu_priority.CoreMeter) the score
# waits for the held reply's first chunk (ReplyRun.past_first_chunk, at most SCORE_WAIT_MAX_S) and
# the two run one after the other; with a core for each they run side by side, as before.
# Measured with bench/live_latency.py (auto, 8 questions, two alternating pairs per condition):
# one core busy, always waiting: first audio after the reply's start 159 / 136 vs 181 / 191 ms,
# voice-to-voice 444 / 467 vs 466 / 503; idle, always waiting: voice-to-voice 564 / 521 vs
# 484 / 434 (the endpoint then waits for chunk + score instead of the longer of the two).
JUDGE_NICE = 5
SIDE_BY_SIDE_CORES = 1.5  # spare cores from which the score runs beside the reply's first chunk
SCORE_WAIT_MAX_S = 0.5  # the longest a score waits for a first chunk (a reply may be slow to start)


class SmartTurnJudge:
    """:class:`~omnidesk.engine.vad.TurnJudge` over a loaded Smart Turn model."""

    name = "smart-turn-v3"

    def __init__(self, model, blocking: bool = False, cores: CoreMeter | None = None):
        self.model = model
        self.window_s = model.window_samples / model.cfg.sampling_rate  # what the model looks at (8 s)
        self.blocking = blocking
        self._pool = None if blocking else concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="end-of-turn", initializer=lower_this_thread,
            initargs=(JUDGE_NICE, "end-of-turn"))
        self._future: concurrent.futures.Future | None = None
        self._ready: tuple[float, float] | None = None
        self.cores = cores or CoreMeter()
        self._after: threading.Event | None = None  # see score_after

    def _score(self, audio: np.ndarray, after: threading.Event | None = None) -> tuple[float, float]:
        if after is not None:
            after.wait(SCORE_WAIT_MAX_S)
        t0 = time.thread_time()  # CPU time of this thread: what the score costs, not how long it waited
        p = float(self.model.score(audio))
        return p, (time.thread_time() - t0) * 1000.0

    @property
    def pending(self) -> bool:
        # until poll hands the verdict out: a score that finishes between a poll and this check
        # still holds the silence rule (Endpointer) for the frame that takes it
        return self._future is not None or self._ready is not None

    def score_after(self, event: threading.Event | None) -> None:
        """Scores submitted from now on wait for ``event`` (a held reply's first chunk) where the
        machine has no core to spare for them beside it (see SIDE_BY_SIDE_CORES); None: never."""
        self._after = event

    def submit(self, audio: np.ndarray) -> None:
        self._ready = None
        if self.blocking:  # inline: the verdict lands when an instant model's would (no waiting)
            self._ready = self._score(audio)
            return
        after = self._after
        if after is not None and not after.is_set():
            spare = self.cores.spare()
            if spare is None or spare >= SIDE_BY_SIDE_CORES:
                after = None
        self._future = self._pool.submit(self._score, audio, after)

    def poll(self) -> tuple[float, float] | None:
        if self._future is not None and self._future.done():
            future, self._future = self._future, None
            try:
                self._ready = future.result()
            except Exception:  # noqa: BLE001 - a failed score is no verdict: the fixed rule decides
                log.exception("end-of-turn scoring failed; the fixed silence rule decides this pause")
                self._ready = None
        ready, self._ready = self._ready, None
        return ready

    def discard(self) -> None:
        """Forget a verdict not yet taken; a score being computed finishes unread."""
        self._future = None
        self._ready = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def smart_turn_missing() -> str | None:
    """Why "auto" would run the silence rule here (what to install or repair), or None when the
    Smart Turn model is there (cheap: for the window's status line)."""
    from .smart_turn import SmartTurn

    return SmartTurn.missing()


def make_judge(choice: str = "auto", blocking: bool = False) -> SmartTurnJudge | None:
    """The judge for an end-of-turn setting: None for "fixed", or for "auto" when Smart Turn is
    not installed (logged once).  "smart" raises TurnModelUnavailable (it says what to install)."""
    if choice not in END_OF_TURN_CHOICES:
        raise ValueError(f"end of turn must be one of {', '.join(END_OF_TURN_CHOICES)}, got {choice!r}")
    if choice == "fixed":
        return None
    from .smart_turn import SmartTurn, TurnModelUnavailable

    try:
        model = SmartTurn.load()
    except TurnModelUnavailable as e:
        if choice == "smart":
            raise
        log.info("end of turn: fixed silence rule (%s)", e)
        return None
    return SmartTurnJudge(model, blocking=blocking)


__all__ = ["END_OF_TURN_CHOICES", "SmartTurnJudge", "make_judge", "smart_turn_missing"]
