"""The reference backend: runs the stateful graph with the IR interpreter.

It is the slow oracle every other backend is checked against: no compilation, no kernels of its
own, only `kiln.ir.run_graph` and the op registry's reference implementations. It owns the KV
buffers like any backend: zeros shaped by the graph's cache inputs, fed on every call and
replaced by the updated caches the graph returns (outputs[1:]).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.backends.cache_rows import check_rows, run_at_rows
from kiln.backends.executable import BackendOptions, Executable, cache_inputs
from kiln.backends.paged_feeds import layout_feeds, paged_layout
from kiln.backends.token_trees import has_token_trees, refuse_trees, tree_feeds
from kiln.ir import Graph, evaluate, run_graph, to_torch, verify

NAME = "reference"


def backend_version() -> str:
    """The version of what actually computes: torch (the interpreter runs plain torch ops)."""
    return torch.__version__


class ReferenceExecutable(Executable):
    """A stateful graph plus its KV buffers, run node by node by the interpreter."""

    def __init__(self, graph: Graph, options: BackendOptions):
        verify(graph)
        self.graph = graph
        self.options = options
        bounds = {name: bound.max for name, bound in graph.symbols.items()}
        caches = [
            torch.zeros([evaluate(d, bounds) for d in v.type.shape], dtype=to_torch(v.type.dtype))
            for v in cache_inputs(graph)
        ]
        self.hold_caches(caches, [c.shape for c in caches])
        self.token_trees = has_token_trees(graph)
        self.paged = paged_layout(graph)

    def reset(self) -> None:
        """Zero every KV buffer (in place: views of the buffers stay valid)."""
        for cache in self.caches:
            cache.zero_()

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        first_row: int = 0,
        *,
        slots=None,
        tree=None,
        block_table=None,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab] for int64 tokens/positions [batch, seq]; updates the caches
        of rows [first_row, first_row + batch). `slots`/`tree`: see kiln.backends.token_trees;
        `block_table` (a paged cache): kiln.backends.paged_feeds."""
        table = layout_feeds(self.paged, tokens.size(0), first_row, block_table)
        check_rows(first_row, tokens.size(0), self.max_batch)
        extra = tree_feeds(positions, slots, tree) if self.token_trees else refuse_trees(slots, tree)
        return run_at_rows(self._run_front, self.caches, tokens, positions, first_row, (*table, *extra))

    def cache_views(self) -> list[torch.Tensor]:
        return self.caches

    def _run_front(self, tokens: torch.Tensor, positions: torch.Tensor, *tree_feeds) -> torch.Tensor:
        feeds = [tokens.to(torch.int64), positions.to(torch.int64), *self.caches, *tree_feeds]
        outputs = run_graph(self.graph, feeds)
        for cache, updated in zip(self.caches, outputs[1:]):  # in place: views of the buffers stay valid
            cache.copy_(updated)
        return outputs[0]

    def save(self, directory: Path) -> list[str]:
        """The reference backend has no files of its own: graph.kir and the weights suffice."""
        return []


def lower(graph: Graph, options: BackendOptions) -> ReferenceExecutable:
    """'Compile' a stateful graph (with weights attached) for the interpreter."""
    return ReferenceExecutable(graph, options)


def load(
    directory: Path, graph: Graph, weights: dict[str, torch.Tensor], options: BackendOptions
) -> ReferenceExecutable:
    """Rebuild the executable from an artifact's graph and weights (no files of its own to read)."""
    graph.weights = dict(weights)
    return ReferenceExecutable(graph, options)
