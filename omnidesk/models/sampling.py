"""Token choice with the reference's logits processors, in the reference's order.

Order (as transformers' generate applies them): repetition penalty over every
id already in the sequence (prompt included), suppressed ids, then - only when
sampling - temperature, top-k, top-p.  ``greedy`` keeps the processors and
takes the argmax, which is what the reference does with ``do_sample=False``.
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


class Sampler:
    """Chooses tokens for one sequence; keeps a preallocated mask of ids seen so far."""

    def __init__(self, params: SamplingParams, vocab_size: int, device="cpu", generator: torch.Generator | None = None):
        self.params = params
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.generator = generator
        self._suppress = torch.tensor(params.suppress_ids, dtype=torch.long, device=device)

    def observe(self, ids) -> None:
        """Mark ids as part of the sequence (prompt ids and every chosen token)."""
        if isinstance(ids, int):
            self.seen[ids] = True
        else:
            self.seen[torch.as_tensor(ids, dtype=torch.long, device=self.seen.device)] = True

    def reset(self) -> None:
        self.seen.zero_()

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        scores = logits.float()
        if p.repetition_penalty != 1.0:
            penalised = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
            scores = torch.where(self.seen, penalised, scores)
        if self._suppress.numel():
            scores = scores.index_fill(-1, self._suppress, float("-inf"))
        return scores

    def choose(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id (also recorded as seen)."""
        scores = self.process(logits)
        p = self.params
        if p.greedy:
            token = int(torch.argmax(scores))
        else:
            scores = scores / p.temperature
            if p.top_k > 0:
                k = min(p.top_k, scores.shape[-1])
                kth = torch.topk(scores, k).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_scores, order = torch.sort(scores, descending=False)
                cumulative = sorted_scores.softmax(-1).cumsum(-1)
                remove = cumulative <= (1 - p.top_p)
                remove[-1] = False  # always keep the most likely token
                scores = scores.scatter(-1, order, sorted_scores.masked_fill(remove, float("-inf")))
            probs = scores.softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.seen[token] = True
        return token
