"""A request's draft cache for "whole" context eagle heads: the draft layer's keys and values
over every context position whose target state is known.

Position t's entry is the layer's key and value of fc(h_t, emb(x_{t+1})), h_t the target's real
state (solved from the logits row at t, last_hidden.py). The drafter hands over states as the
target makes them (prefill's rows, then each verification's rows of the accepted tokens: the
drafted nodes that were rejected never get there); before each draft the states of positions
before the newest are added to the cache, and the newest one (whose next token is the newest
token) seeds the draft, which attends over the cache and then over its own positions. A position
whose state never came (a prompt prefix the engine copied instead of computing) is simply
absent: RoPE keeps the others' distances.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DraftCache:
    def __init__(self, heads):
        self.heads = heads
        self.keys: torch.Tensor | None = None  # [1, kv_heads, length, head_dim]
        self.values: torch.Tensor | None = None
        self.end = 0  # the position after the last entry: where the next draft starts
        self.pending: dict[int, torch.Tensor] = {}  # position -> the target's state there

    @property
    def length(self) -> int:
        """Entries held."""
        return 0 if self.keys is None else self.keys.shape[2]

    def observe(self, states: torch.Tensor, first: int) -> None:
        """The target's states [k, hidden] at positions first .. first + k - 1."""
        for offset, state in enumerate(states):
            self.pending[first + offset] = state

    @torch.inference_mode()
    def seed(self, context: Sequence[int]) -> torch.Tensor | None:
        """The newest position's state (the draft starts from it at `end`), after adding every
        earlier pending position to the cache; None when the newest state is unknown."""
        newest = len(context) - 2  # its logits chose the newest token
        state = self.pending.get(newest)
        if state is None:
            return None
        earlier = sorted(t for t in self.pending if self.end <= t < newest)
        if earlier:
            states = torch.stack([self.pending[t] for t in earlier])
            tokens = torch.tensor([context[t + 1] for t in earlier])
            self._add(self.heads._input(states, tokens), torch.tensor(earlier))
        self.pending = {newest: state}
        self.end = newest
        return state

    def _add(self, inputs: torch.Tensor, positions: torch.Tensor) -> None:
        _, keys, values = self.heads._project(inputs[None], positions)
        if self.keys is not None:
            keys, values = torch.cat((self.keys, keys), dim=2), torch.cat((self.values, values), dim=2)
        self.keys, self.values = keys, values
