"""`HeadsDrafter`: drafts from trained heads on the target's last hidden state.

SpeculativeGeneration tells the drafter the raw logits row that chose the newest token
(`observe`); the hidden state is solved from it (last_hidden.py) and the heads draft one chain of
up to `stages` tokens after that token (speculator_heads.py). Before the first observation, or
after a context the drafter did not see grow, it proposes nothing (the target decodes alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.last_hidden import HiddenFromLogits, output_head
from kiln.runtime.speculator_heads import DraftHeads, load_heads


class HeadsDrafter:
    def __init__(
        self, heads: DraftHeads, to_hidden: HiddenFromLogits, min_confidence: float = 0.0, alternatives: int = 2
    ):
        self.heads, self.to_hidden, self.min_confidence = heads, to_hidden, min_confidence
        self.alternatives = alternatives
        self.hidden: torch.Tensor | None = None

    @classmethod
    def from_artifact(
        cls, directory, manifest: dict, graph, kind: str | None = None, min_confidence: float = 0.0
    ) -> HeadsDrafter:
        """The heads of `kind` stored in the artifact at `directory` (ArtifactError if there are
        none, they are damaged or belong to another model)."""
        head = output_head(graph)
        heads, rows = load_heads(Path(directory), manifest, head, kind)
        return cls(heads, HiddenFromLogits(head, rows), min_confidence)

    def observe(self, logits: torch.Tensor) -> None:
        """The raw logits [vocab] that chose the newest token."""
        with _one_thread():
            self.hidden = self.to_hidden(logits.detach())

    def propose(self, context: Sequence[int], max_tokens: int) -> DraftTree:
        """The heads' greedy chain after the newest token, with runners-up for its first token
        (`DraftHeads.draft_tree`; a caller that verifies chains takes the chain alone)."""
        if self.hidden is None or max_tokens < 1:
            return DraftTree.chain([])
        with _one_thread():
            return self.heads.draft_tree(
                self.hidden, int(context[-1]), max_tokens, self.alternatives, self.min_confidence
            )

    def feedback(self, drafted: int, accepted: int) -> None:
        pass  # the next observe() carries everything the heads need


@contextmanager
def _one_thread():
    """The heads' matrices are a few MB: a second thread buys little and costs a synchronization
    per op, which on a machine other processes keep busy can take milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
