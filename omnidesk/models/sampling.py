"""Token choice with the reference's logits processors, in the reference's order.

Order (as transformers' generate applies them): repetition penalty over every
id already in the sequence (prompt included), suppressed ids, then - only when
sampling - temperature, top-k, top-p.  ``greedy`` keeps the processors and
takes the argmax, which is what the reference does with ``do_sample=False``.
:func:`sample` is the choice as a pure function on the device, the form a
compiled or captured decode step calls (omnidesk.models.runner).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    suppress_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature <= 0 and not self.greedy:
            raise ValueError("temperature must be > 0 when sampling (use greedy instead)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


def device_generator(device: torch.device | str) -> torch.Generator:
    """A random generator on ``device``; a CPU one for the meta device (an executor built only to check
    a config draws nothing, and the meta device has no generator)."""
    device = torch.device(device)
    return torch.Generator() if device.type == "meta" else torch.Generator(device=device)


def sample(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
           noise: torch.Tensor | None = None, suppress: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] -> token ids [..., 1] (long), on the device, without a host sync.

    The processors in the reference's order (module docstring).  A draw is the argmax of
    probs / Exp(1) noise, an exact sample of probs that needs no cumulative sum: ``noise`` (the shape
    of ``logits``) is drawn by the caller (:meth:`Sampler.draw`), outside any compiled or captured
    step, where a torch.Generator may run.  Greedy needs no noise.  ``seen`` [V] bool marks the ids
    the repetition penalty applies to.  Pure: nothing is written, so a decode step can call it."""
    p = params
    scores = logits.float()
    if p.repetition_penalty != 1.0 and seen is not None:
        penalised = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if suppress is not None and suppress.numel():
        scores = scores.index_fill(-1, suppress, float("-inf"))
    if p.greedy:
        return scores.argmax(-1, keepdim=True)
    if noise is None:
        raise ValueError("sampling needs noise (Sampler.draw); only greedy choice runs without")
    scores = scores / p.temperature
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        remove = cumulative <= (1 - p.top_p)
        # always keep the most likely token (a cat, not an item assignment: that copies a host value,
        # which a CUDA graph cannot capture)
        remove = torch.cat((remove[..., :-1], torch.zeros_like(remove[..., -1:])), dim=-1)
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(remove, float("-inf")))
    return (scores.softmax(-1) / noise).argmax(-1, keepdim=True)


class Sampler:
    """Chooses tokens for one sequence: its parameters, the mask of ids seen so far, its noise.

    :meth:`choose` is the eager convenience (a Python int, one host sync).  A decode step
    calls :func:`sample` itself with ``seen``, ``suppress`` and the noise :meth:`draw` put in
    ``noise``, and marks its choice with :meth:`mark` (both without a host sync)."""

    def __init__(self, params: SamplingParams, vocab_size: int, device="cpu", generator: torch.Generator | None = None,
                 rows: int = 1):
        self.params = params
        self.generator = generator
        self.suppress = torch.tensor(params.suppress_ids, dtype=torch.long, device=device) \
            if params.suppress_ids else None
        # rows: draws per step (Qwen3-Omni's code predictor samples its 15 codebooks in one step)
        shape = (vocab_size,) if rows == 1 else (rows, vocab_size)
        # normal tensors even when made under inference_mode: a later step outside it writes them
        with torch.inference_mode(False):
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.noise = None if params.greedy else torch.empty(shape, dtype=torch.float32, device=device)

    def observe(self, ids) -> None:
        """Mark ids as part of the sequence (prompt ids and every chosen token)."""
        if isinstance(ids, int):
            self.seen[ids] = True
        else:
            self.seen[torch.as_tensor(ids, dtype=torch.long, device=self.seen.device)] = True

    def mark(self, token: torch.Tensor) -> None:
        """Mark a chosen token id (a device tensor [1]) as seen, without a host sync."""
        self.seen.index_fill_(0, token.reshape(-1), True)

    def reset(self) -> None:
        self.seen.zero_()

    def draw(self) -> torch.Tensor | None:
        """Fresh Exp(1) noise for the next :func:`sample` call (None when greedy)."""
        if self.noise is not None:
            self.noise.exponential_(generator=self.generator)
        return self.noise

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> token id [1] on the device (also marked as seen); no host sync."""
        token = sample(logits, self.params, self.seen, self.draw(), self.suppress)
        self.mark(token)
        return token

    def choose(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id (also recorded as seen)."""
        return int(self.pick(logits))
