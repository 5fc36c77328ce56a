"""`HeadsDrafter`: drafts from trained heads on the target's last hidden state.

SpeculativeGeneration tells the drafter the raw logits row that chose the newest token
(`observe`); the hidden state is solved from it (last_hidden.py) and the heads draft one chain of
up to `stages` tokens after that token (speculator_heads.py); eagle heads grow a token tree from
their own probabilities instead (eagle_tree.py). Before the first observation, or after a context
the drafter did not see grow, it proposes nothing (the target decodes alone). Eagle heads that
attend over the whole context also take the states of every position the target verified, and of
the prompt (`observe_rows`), into a draft cache of their own (eagle_context.py).

The stored heads are made cheaper to draft with once, at load (`DraftSettings`): a smaller draft
vocabulary (its most frequent tokens) and int8 weights, chosen by
bench/draft_readout.py's measurement of draft time against acceptance; on a backend that lowers
it, draft-context eagle heads' step is captured into Kiln's IR and compiled (eagle_step.py). A drafter whose drafts
lose (fewer tokens accepted per draft than pay for the draft and the wider verifying step) rests
for a few target steps at a time, so speculation costs little where the heads guess badly.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.eagle_context import DraftCache
from kiln.runtime.eagle_tree import grow_tree
from kiln.runtime.last_hidden import HiddenFromLogits, output_head
from kiln.runtime.speculator_heads import DraftHeads, load_heads


@dataclass(frozen=True)
class DraftSettings:
    vocab: int | None = 2048  # the draft vocabulary's most frequent tokens kept (None: all it was trained on)
    int8: bool = True  # int8 weights (Int8Linear) in the readouts and the stage matrices
    tree_top_k: int = 3  # eagle: nodes expanded per level, and children proposed per node
    tree_nodes: int = 8  # eagle: the tree's size (0: the greedy chain with stage 0's runners-up)
    tree_min_probability: float = 0.0  # eagle: nodes whose path the draft finds less likely are dropped
    min_confidence: float = 0.0
    alternatives: int = 2  # stage 0's runners-up beside a chain
    # below this many tokens accepted per draft (a running average), drafting loses to plain
    # decoding: the drafter rests for `rest_steps` target steps, then tries again (0: never rests)
    pause_below: float = 0.0
    rest_steps: int = 8
    # eagle heads over the draft's own positions: each draft position run by the artifact's
    # backend from the step captured into Kiln's IR (eagle_step.py), where the backend lowers it
    compiled: bool = True


DEFAULT_SETTINGS = DraftSettings()


class HeadsDrafter:
    def __init__(self, heads: DraftHeads, to_hidden: HiddenFromLogits, settings: DraftSettings = DEFAULT_SETTINGS):
        self.heads, self.to_hidden, self.settings = heads, to_hidden, settings
        self.hidden: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None  # solved into `hidden` when a draft needs it
        self.accepted_average, self.resting = 1.0, 0
        self.cache = DraftCache(heads) if getattr(heads, "context", None) == "whole" else None

    @property
    def reads_prompt(self) -> bool:
        """Whether the prompt's logits rows are wanted (observe_rows), not its last one alone."""
        return self.cache is not None

    @classmethod
    def from_artifact(
        cls, directory, manifest: dict, graph, kind: str | None = None, settings: DraftSettings | None = None
    ) -> HeadsDrafter:
        """The heads of `kind` stored in the artifact at `directory` (ArtifactError if there are
        none, they are damaged or belong to another model), compacted as `settings` say
        (default: DEFAULT_SETTINGS)."""
        settings = settings or DEFAULT_SETTINGS
        head = output_head(graph)
        heads, rows = load_heads(Path(directory), manifest, head, kind)
        backend = manifest.get("backend")
        compiling = settings.compiled and step_compiles(heads, backend)
        heads.compact(settings.vocab, settings.int8 and not compiling)
        if compiling:
            attach_compiled_step(heads, settings, backend)
        return cls(heads, HiddenFromLogits(head, rows), settings)

    def fresh(self) -> HeadsDrafter:
        """A drafter over the same heads with no state of its own yet (one per request)."""
        return HeadsDrafter(self.heads, self.to_hidden, self.settings)

    def observe(self, logits: torch.Tensor) -> None:
        """The raw logits [vocab] that chose the newest token (solved into the hidden state only
        when a draft is made: a resting drafter skips that product)."""
        self.logits, self.hidden = logits.detach(), None

    def observe_rows(self, logits: torch.Tensor, first: int) -> None:
        """The raw logits rows [k, vocab] at positions first .. first + k - 1 of the context (row
        t chose token t + 1; the last chose the newest token), kept as states for the draft cache
        (called when reads_prompt: whole-context heads)."""
        with _one_thread():
            self.cache.observe(self.to_hidden(logits.detach()), first)

    def propose(self, context: Sequence[int], max_tokens: int) -> DraftTree:
        """Eagle heads' grown tree (`grow_tree`), or the heads' greedy chain after the newest
        token with runners-up for its first token (`DraftHeads.draft_tree`); a caller that
        verifies chains takes the tree's first path, the greedy chain."""
        if self.resting > 0:
            self.resting -= 1
            return DraftTree.chain([])
        if self.cache is not None:
            return self._propose_in_context(context, max_tokens)
        if (self.hidden is None and self.logits is None) or max_tokens < 1:
            return DraftTree.chain([])
        settings, token = self.settings, int(context[-1])
        with self._threads():
            if self.hidden is None:
                self.hidden = self.to_hidden(self.logits)
            if self.heads.kind == "eagle" and settings.tree_nodes > 0:
                return grow_tree(
                    self.heads,
                    self.hidden,
                    token,
                    max_tokens,
                    settings.tree_top_k,
                    settings.tree_nodes,
                    settings.tree_min_probability,
                )
            return self.heads.draft_tree(self.hidden, token, max_tokens, settings.alternatives, settings.min_confidence)

    def _propose_in_context(self, context: Sequence[int], max_tokens: int) -> DraftTree:
        """As propose, for whole-context eagle heads: the draft cache takes the new positions'
        states first, and the draft attends over it."""
        if max_tokens < 1 or len(context) < 2:
            return DraftTree.chain([])
        settings, token = self.settings, int(context[-1])
        with _one_thread():
            hidden = self.cache.seed(context)
            if hidden is None:
                return DraftTree.chain([])
            if settings.tree_nodes > 0:
                return grow_tree(
                    self.heads,
                    hidden,
                    token,
                    max_tokens,
                    settings.tree_top_k,
                    settings.tree_nodes,
                    settings.tree_min_probability,
                    self.cache,
                )
            return self.heads.draft_tree(
                hidden, token, max_tokens, settings.alternatives, settings.min_confidence, context=self.cache
            )

    def _threads(self):
        """One thread for the torch layer; a compiled step runs with the engine's threads: its
        few calls a position cost less than switching the thread count each draft (2.9-3.1 ms
        against 3.9-4.7 ms a tree on SmolLM2, Xeon)."""
        return nullcontext() if getattr(self.heads, "compiled_step", None) is not None else _one_thread()

    def feedback(self, drafted: int, accepted: int) -> None:
        """The next observe() carries what the heads need; this keeps the running average of
        tokens accepted per draft, and rests the drafter while it is below `pause_below`."""
        if drafted == 0:
            return
        self.accepted_average = 0.7 * self.accepted_average + 0.3 * accepted
        if self.accepted_average < self.settings.pause_below:
            self.resting = self.settings.rest_steps


def step_compiles(heads: DraftHeads, backend: str | None) -> bool:
    """Whether `backend` lowers the draft step of `heads` (eagle_step.py): eagle heads over the
    draft's own positions, on a backend that lowers it; others keep the torch layer."""
    from kiln.runtime.eagle_step import COMPILING_BACKENDS

    if heads.kind != "eagle" or heads.context != "draft" or backend not in COMPILING_BACKENDS:
        return False
    return heads.stages >= 2 and heads.shape.cos is not None  # the step's fixed shapes assume both


def attach_compiled_step(heads: DraftHeads, settings: DraftSettings, backend: str) -> None:
    """The compacted (fp32) heads' step captured, with int8 weights as `settings.int8` says, and
    lowered by `backend` for a tree level's rows; where that fails (no C++ compiler, say) the
    torch layer drafts, its weights int8 as the settings say, with a warning naming why."""
    from kiln.ir.errors import KilnError
    from kiln.runtime.eagle_step import CompiledEagleStep

    rows = min(settings.tree_top_k if settings.tree_nodes > 0 else 1, len(heads.vocab_ids))
    try:
        with _one_thread():  # its elementwise kernels compiled for one thread: too small to share
            heads.compiled_step = CompiledEagleStep(heads, max(rows, 1), backend, settings.int8)
    except (KilnError, RuntimeError, OSError) as error:  # e.g. no C++ compiler for Inductor
        warnings.warn(f"the eagle heads draft in torch: their step did not compile ({error})", stacklevel=3)
        heads.compact(None, settings.int8)


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
