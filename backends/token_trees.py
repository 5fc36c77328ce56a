"""Token trees in one step: the `slots` and `tree` inputs of a graph compiled with them.

A graph whose `insert_kv_cache` ran with `token_trees` takes, after its KV buffers, `slots`
i64[batch, seq] (where each token's keys and values are written and attend from) and `tree`
bool[batch, seq, seq] (which of the call's tokens each one sees), beside `positions` (each
token's position in its sequence, for RoPE). A plain call is slots = positions with a
lower-triangular tree; a token tree (draft candidates sharing a prefix) puts its tokens in
consecutive slots from the row's length, each at the position of its depth, seeing its ancestors.
`run(tokens, positions, first_row, slots=..., tree=...)` of an executable whose graph has them
takes both; `tree_feeds` fills what a caller leaves out.
"""

from __future__ import annotations

import functools

import torch

from .errors import FeedError

TREE_INPUTS = ("slots", "tree")


def has_token_trees(graph) -> bool:
    """Whether the graph takes `slots` and `tree` (compiled with token trees)."""
    return tuple(v.name for v in graph.inputs[-2:]) == TREE_INPUTS


def verifies_trees(graph) -> bool:
    """Whether a token tree may be verified in one call of this graph: it takes the tree inputs,
    and no attention layer needs a key's sequence position apart from its slot (ALiBi biases and
    sliding windows shorter than the cache measure distances in slots, which siblings lengthen)."""
    if not has_token_trees(graph):
        return False
    slots = graph.meta.get("kv_cache", {}).get("max_seq_len", 0)
    return not any(
        n.op == "attention" and (n.attrs.get("alibi") or 0 < (n.attrs.get("window") or 0) < slots) for n in graph.nodes
    )


def executable_verifies_trees(executable) -> bool:
    """`verifies_trees` of an executable's graph, or what one that keeps no graph says of it
    (False for one that shows neither: a test's stand-in)."""
    said = getattr(executable, "verifies_trees", None)
    if isinstance(said, bool):
        return said
    graph = getattr(executable, "graph", None)
    return graph is not None and verifies_trees(graph)


@functools.lru_cache(maxsize=64)
def lower_triangle(seq: int) -> torch.Tensor:
    """bool [seq, seq]: each token sees itself and those before it (a plain call's tree); shared, read-only."""
    return torch.ones(seq, seq, dtype=torch.bool).tril()


def tree_feeds(
    positions: torch.Tensor, slots: torch.Tensor | None, tree: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, tree) for a call: a plain call's (positions, lower triangle) where not given."""
    batch, seq = positions.shape
    if slots is None:
        slots = positions
    elif slots.shape != positions.shape:
        raise FeedError(f"slots {list(slots.shape)} must be shaped as positions {list(positions.shape)}")
    if tree is None:
        tree = lower_triangle(seq).expand(batch, seq, seq)
    elif tree.shape != (batch, seq, seq) or tree.dtype != torch.bool:
        raise FeedError(
            f"tree must be bool [batch, seq, seq] = {[batch, seq, seq]}, got {tree.dtype} {list(tree.shape)}"
        )
    return slots.to(torch.int64).contiguous(), tree.contiguous()


def refuse_trees(slots, tree) -> tuple:
    """For an executable whose graph has no tree inputs: no feeds; a call that gives them is an error."""
    if slots is not None or tree is not None:
        raise FeedError(
            "this artifact was compiled without token-tree inputs (slots, tree). Fix: compile it "
            "again with this version of Kiln, or verify drafts as one chain."
        )
    return ()
