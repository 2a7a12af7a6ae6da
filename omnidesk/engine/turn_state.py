"""What the turn-based engine (:mod:`omnidesk.engine.engine`) is set up with and what it reports: its
turn states, its settings, its counters and the record of a failed turn (the full-duplex engine
reports with the same states, counters and failures).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .timeline import TurnTimeline


class TurnState(enum.Enum):
    LISTENING = "listening"
    USER_SPEAKING = "user_speaking"
    PREEMPTING = "preempting"
    RESPONDING = "responding"
    SUSPECTED_BARGE_IN = "suspected_barge_in"


@dataclass
class EngineConfig:
    voice: str | None = None
    seed: int = 0
    preemptive: bool = True  # start replying at a short pause, play only at the endpoint
    barge_in: bool = True  # user speech during a reply interrupts it
    thinker_lead: int = 24  # text tokens the thinker may run ahead of the talker
    max_audio_ahead_s: float = 2.0  # generated audio waiting to be played before generation pauses
    # After a reply has played, its echo still reaches the microphone for a moment (room, device
    # buffers); until then only a barge-in-length run of speech starts a turn, so a residue of the
    # assistant's own voice is not taken for the user.
    echo_tail_s: float = 0.5
    # Adaptive playout delay (a jitter buffer, as in VoIP): when the speaker ran dry during the
    # first seconds of the last reply (the second vocoder chunk came late: a slow CPU), start the
    # next reply that much later instead of leaving a gap after its first chunk.  0 on machines
    # that keep up.
    adaptive_playout: bool = True
    max_playout_delay_s: float = 0.3


@dataclass
class EngineStats:
    preemptive_used: int = 0
    preemptive_discarded: int = 0
    barge_ins: int = 0
    false_barge_ins: int = 0
    steps: int = 0
    failed_turns: int = 0


@dataclass(frozen=True)
class TurnFailure:
    """A turn that failed: the stage that raised (executor.STAGES) and what it said.

    Sent to ``on_update("error", failure)``; ``str()`` is the sentence a user reads."""

    stage: str
    message: str
    t: float  # session time of the failure
    turn: TurnTimeline | None
    conversation_kept: bool  # False: the failure left the model's state unusable and it was cleared

    def __str__(self) -> str:
        rest = "the conversation goes on" if self.conversation_kept else "the conversation was cleared"
        return f"the reply failed in the {self.stage}: {self.message} (that turn was dropped; {rest})"
