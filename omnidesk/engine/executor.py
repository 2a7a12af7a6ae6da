"""The executor interface: everything that differs between model families.

The engine (scheduling, turn state machine, timeline, playback) is shared; a
model family plugs in as one :class:`Executor`.  An executor is synchronous
and single-threaded: the engine calls it from its one worker thread, one call
at a time, and every call is short (one decode step, one audio block, one
vocoder chunk), so an interruption is served between calls.

A conversation is a sequence of turns.  For each user turn the engine calls

    begin_user_turn()                      # the turn's text prefix
    add_user_audio(samples)                # any number of times while the user speaks:
                                           #   finished encoder blocks are prefilled at once
    end_user_turn()                        # the audio tail + the assistant header
    start_reply(voice, seed)
    then, until reply_done: thinker_step() / talker_step() / vocoder_step()
    finish_reply()  or  interrupt(heard_samples)

If any call raises, the engine calls ``abandon_turn()``: the executor forgets the
failed turn (its audio, prompt and reply) and is back where the turn began, so
the conversation goes on.  Executors tag their exceptions with the stage they
come from (``with stage("vocoder"): ...``); the engine reports it.

``mark()`` / ``rollback(mark)`` undo everything since the mark in O(1) (a
preemptive reply whose user kept talking).

Optional, additive hooks (defaults keep every local executor as it was):

* ``turn_extras(now)``: per-turn fields for the timeline that only the executor
  knows (the remote executor's ``network`` record).  The engine merges what it
  returns into the current turn's ``extra`` whenever it reports the turn.
* ``local_talker``: True (the default) when the talker runs here and reads the
  thinker's tokens, so the engine keeps the thinker at most
  ``EngineConfig.thinker_lead`` tokens ahead of it.  An executor whose text and
  speech arrive already made (a server streaming both) sets it False: there is
  nothing to pace, and its ``vocoder_step`` hands over audio as it arrives.
* ``end_session()``: the driver closed its session (or restarts it) after its
  worker stopped, perhaps in the middle of a reply the engine just cancelled
  (``Engine.aclose``) without telling the executor.  An executor with work of
  its own still running (the remote executor's stream) stops it there.

What each family must define is listed as abstract methods below; a Qwen3-Omni
executor would expand its 16 codebooks in ``talker_step`` (MTP head) and a
Moshi-style executor would run its depth transformer there, each with its own
vocoder in ``vocoder_step``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


# "server": a remote executor's model server (omnidesk.remote): unreachable, refused, or failed mid-reply
STAGES = ("encoder", "thinker", "talker", "vocoder", "voice", "speaker", "engine", "server")


class StageError(RuntimeError):
    """A failure in one stage of the pipeline (one of :data:`STAGES`), wrapping the original error."""

    def __init__(self, stage: str, cause: BaseException):
        self.stage = stage
        self.cause = cause
        text = str(cause).strip() or "no message"
        super().__init__(f"{type(cause).__name__}: {text}")


@contextmanager
def stage(name: str):
    """Tag any exception raised inside with the stage it came from (the innermost tag wins)."""
    try:
        yield
    except StageError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with its stage
        raise StageError(name, e) from e


@dataclass
class Rollback:
    """What an interruption kept and dropped (all counts in tokens / samples)."""

    heard_samples: int
    kept_text_tokens: int
    rolled_back_tokens: int
    thinker_cache_before: int
    thinker_cache_after: int


@dataclass
class StepResult:
    """What one pipeline step produced."""

    text_token: int | None = None
    codec_token: int | None = None
    audio: list[np.ndarray] = field(default_factory=list)


class Executor(ABC):
    sample_rate_in: int  # what add_user_audio takes (16 kHz for Qwen2.5-Omni)
    sample_rate_out: int  # what the vocoder emits (24 kHz)
    block_samples: int  # input samples per encoder block (prefilled while the user speaks)
    # The talker runs here and reads the thinker's tokens (the engine paces the thinker against
    # it); False for an executor whose text and speech arrive already made (see the module docstring).
    local_talker: bool = True

    # conversation ---------------------------------------------------------------------
    @abstractmethod
    def reset_conversation(self) -> None: ...

    @abstractmethod
    def begin_user_turn(self) -> None: ...

    @abstractmethod
    def add_user_audio(self, samples: np.ndarray) -> int:
        """Append utterance audio; encode and prefill every block that became complete. Returns tokens added."""

    @abstractmethod
    def end_user_turn(self) -> list[int]:
        """Encode the tail, prefill it and the assistant header. Returns this turn's prompt ids."""

    @abstractmethod
    def mark(self) -> object: ...

    @abstractmethod
    def rollback(self, mark: object) -> None: ...

    # reply ---------------------------------------------------------------------------
    @abstractmethod
    def start_reply(self, voice: str | None = None, seed: int = 0) -> None: ...

    @abstractmethod
    def thinker_step(self) -> int | None:
        """Decode one text token (None when the text is finished)."""

    @abstractmethod
    def talker_step(self) -> int | None:
        """One codec token, or None when the talker waits for the thinker or has finished."""

    @abstractmethod
    def vocoder_step(self, final: bool = False) -> list[np.ndarray]:
        """Audio chunks that the codes so far allow (``final``: flush everything)."""

    @property
    @abstractmethod
    def thinker_done(self) -> bool: ...

    @property
    @abstractmethod
    def talker_done(self) -> bool: ...

    @property
    @abstractmethod
    def pending_codes(self) -> int:
        """Codes produced but not yet turned into audio."""

    @abstractmethod
    def finish_reply(self) -> None:
        """The reply was played to the end: keep it all in the conversation."""

    @abstractmethod
    def interrupt(self, heard_samples: int) -> Rollback:
        """The user cut in after hearing ``heard_samples`` of the reply: keep only that part."""

    @property
    @abstractmethod
    def thinker_cache_length(self) -> int: ...

    @abstractmethod
    def decode(self, text_ids: list[int]) -> str:
        """Reply text of these ids (for the timeline and the UI)."""

    def take_overflows(self) -> list[dict]:
        """Cache-full events since the last call (old turns dropped and the rest re-prefilled)."""
        return []

    def turn_extras(self, now: float) -> dict:
        """Timeline fields of the current turn that only the executor knows, merged into the turn's
        ``extra`` (timeline.py) each time the engine reports the turn; the latest value of a key
        wins.  ``now``: the session time of this call, for an executor that stamps events on a
        clock of its own (it maps a stamp s to ``now - (its clock now - s)``).  Keys must not be
        contract fields.  Called on the engine's loop, not the worker: it must not block.  Default: none."""
        return {}

    @property
    def warming_up(self) -> bool:
        """Whether hot steps are still being compiled in the background (the conversation runs
        eagerly meanwhile, and the compile takes CPU from it: a reply's start-up may run dry for
        that reason alone).  Default: the executor's decode runner, if it has one."""
        runner = getattr(self, "runner", None)
        return runner is not None and not runner.ready

    def end_session(self) -> None:
        """The session driving this executor closed (or restarts): stop what still runs in the
        background for an unfinished reply.  Called once the engine's worker has stopped, so no
        step is in flight.  The executor stays usable: a restarted session goes on with it.
        Default: nothing (a local executor does its work only inside the worker's calls)."""

    def abandon_turn(self) -> bool:
        """A turn failed part-way: forget it and its reply, back to the conversation before it.

        Returns True when the earlier conversation was kept, False when it had to be cleared
        (the default, for executors that cannot tell how far a failure got)."""
        self.reset_conversation()
        return False

    @property
    @abstractmethod
    def turn_prompt_ids(self) -> list[int]:
        """Everything fed to the thinker for the latest user turn (placeholders included)."""


def end_session(executor) -> None:
    """Tell ``executor`` its session closed (:meth:`Executor.end_session`), once the engine's worker
    has stopped; every driver (live, the window's sound files, ``talk``) calls this.  A duplex
    executor has no such hook.  Never raises: closing must go on."""
    hook = getattr(executor, "end_session", None)
    if hook is None:
        return
    try:
        hook()
    except Exception:  # noqa: BLE001 - closing must not raise
        import logging

        logging.getLogger("omnidesk.engine").exception("ending the executor's session failed")
