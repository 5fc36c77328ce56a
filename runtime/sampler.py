"""Turning a row of logits into the next token: greedy, or seeded temperature / top-k / top-p.

Each request row owns a `Sampler` with its own `torch.Generator`, so the tokens a prompt gets
depend only on its logits and its seed, never on what else shares the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.errors import GenerationError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}. Fix: use 0 for greedy.")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {self.top_k}. Fix: use 0 to disable it.")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}. Fix: use 1.0 to disable it.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [vocab] with every token outside the top-k / top-p (nucleus) set set to -inf.

    top-p keeps the smallest set of most likely tokens whose probability mass reaches top_p
    (always at least the most likely token).
    """
    logits = logits.clone()
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop = mass_before >= top_p
        logits[order[drop]] = float("-inf")
    return logits


class Sampler:
    """Picks tokens for one request row; seeded, so the same logits and seed give the same tokens."""

    def __init__(self, params: SamplingParams, seed: int = 0):
        self.params = params
        self.generator = torch.Generator().manual_seed(int(seed))

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token id for logits [vocab]."""
        logits = logits.detach().float().reshape(-1)
        if self.params.greedy:
            return int(torch.argmax(logits))
        logits = filter_logits(logits / self.params.temperature, self.params.top_k, self.params.top_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
