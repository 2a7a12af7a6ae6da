"""One reply in flight in a thinker-talker executor (:mod:`omnidesk.models.thinker_talker`).

What lives from ``start_reply`` until the reply finishes or is cut: the reply's state
(:class:`ReplyState`, which a family's talker extends), the thinker rows handed to the
talker one per talker step (:class:`ReplyFeed`), and the guard on each decode step's
chosen token (:func:`guard_finite` on the device, :func:`read_token` at the host's one
read per step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .sampling import Sampler

# The token a decode step returns when its logits held NaN or Inf (no token id is negative): the executor
# sees it at the one host read it makes per step, and ends the turn with a clear error instead of
# speaking from garbage.  Checked on the device, inside the step: no extra sync.
NONFINITE = -1


class NonFiniteLogits(RuntimeError):
    """A step's logits were NaN or Inf (damaged weights, or activations that overflowed)."""


def guard_finite(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``token``, or :data:`NONFINITE` where ``logits`` hold a NaN or Inf (no host sync)."""
    return torch.where(torch.isfinite(logits).all(), token, torch.full_like(token, NONFINITE))


def read_token(token: torch.Tensor | int, what: str) -> int:
    """The host's one read of a step's chosen token; :class:`NonFiniteLogits` for :data:`NONFINITE`."""
    value = int(token)
    if value == NONFINITE:
        raise NonFiniteLogits(f"the {what} produced NaN or Inf values: this reply stops here (the weights may be "
                              f"damaged: omnidesk models verify checks every tensor)")
    return value


class ReplyFeed:
    """Thinker reply positions handed to the talker, one per talker step.

    ``push`` a reply position (the talker's row for a reply token the thinker has
    already read); ``finish`` when the thinker stopped.  ``next`` returns the next
    vector, ``None`` while the thinker is behind, and after the reply the text-eos
    vector once, then text-pad forever (both families' talkers are fed this way).
    """

    def __init__(self, eos_vector: torch.Tensor, pad_vector: torch.Tensor):
        self._eos, self._pad = eos_vector, pad_vector
        self._queue: deque[torch.Tensor] = deque()
        self.finished = False
        self._eos_sent = False

    def push(self, vector: torch.Tensor) -> None:
        if self.finished:
            raise RuntimeError("ReplyFeed.push after finish")
        self._queue.append(vector)

    def finish(self) -> None:
        self.finished = True

    @property
    def ready(self) -> bool:
        """Whether next() will return a vector now."""
        return bool(self._queue) or self.finished

    def next(self) -> torch.Tensor | None:
        if self._queue:
            return self._queue.popleft()
        if not self.finished:
            return None
        if not self._eos_sent:
            self._eos_sent = True
            return self._eos
        return self._pad


@dataclass(eq=False)
class ReplyState:
    """One reply in flight, from ``start_reply`` until it finishes or is cut.

    The thinker's side is shared; a family's talker keeps what it needs in a subclass
    (:attr:`~omnidesk.models.thinker_talker.ThinkerTalkerExecutor.reply_state`)."""

    text_sampler: Sampler
    feed: ReplyFeed  # thinker reply rows -> talker, one per talker step
    voice: str | None = None  # the voice it speaks with (set by the family's _start_speech)
    text: list[int] = field(default_factory=list)  # reply ids emitted so far
    next_token: torch.Tensor | None = None  # chosen ([1] on the device), not yet emitted
    thinker_done: bool = False
    first_vector: torch.Tensor | None = None  # the first reply row: it ends the talker's prefill
    codes: list = field(default_factory=list)  # one entry per talker step (a frame of codebooks where there are several)
    talker_done: bool = False
    talker_logits: torch.Tensor | None = None  # the talker prefill's last logits (None until the prefill)
    next_code: torch.Tensor | None = None  # the next code ([1] on the device), chosen inside the talker's step
    codec_sampler: Sampler | None = None
    stream: object = None  # the family's streaming vocoder
    vocoded: int = 0  # codes already handed to the vocoder
