"""Token trees grown from the eagle layer's own probabilities (EAGLE-2's dynamic draft tree).

Level by level, the `top_k` likeliest nodes so far (by the product of the draft's probabilities
along their path) are expanded together, one row each through the draft layer: each row keeps the
keys and values of its own ancestors (all rows share the context's draft cache, for heads that
attend over the whole context), so the rows of a level cost one pass over the layer's and the
readout's weights. Each expanded node proposes its `top_k` likeliest children; every
candidate is a node of the tree, and the `max_nodes` likeliest of them are kept (a child is never
likelier than its parent, so what is kept is closed under ancestors). The tree is verified in one
target step with its ancestor mask (kiln.backends.token_trees); children are listed likeliest
first, so the tree's first path is the draft's greedy chain.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from kiln.runtime.draft_tree import DraftTree


@torch.inference_mode()
def grow_tree(
    heads,
    hidden: torch.Tensor,
    token: int,
    depth: int,
    top_k: int,
    max_nodes: int,
    min_probability: float = 0.0,
    context=None,
) -> DraftTree:
    """The draft tree after `token` from the target's state `hidden` [hidden] (EagleHeads;
    "whole" context heads attend over `context`, an eagle_context.DraftCache, too), without
    nodes whose path the draft gives less than `min_probability` (each node verified costs part
    of a target step; an unlikely one seldom pays it back)."""
    top_k = max(1, min(top_k, len(heads.vocab_ids)))
    states, feed, cache = hidden[None], torch.tensor([token]), []
    path_scores, rows_node = torch.zeros(1), [-1]  # log-probability of each row's path, its node
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    start = context.end if context is not None else 0
    levels = min(depth, heads.stages)
    for level in range(levels):
        states, logits = heads.advance(states, feed, cache, level, context, start)
        best = F.log_softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
        candidates = (path_scores[:, None] + best.values).flatten()
        ids = heads.vocab_ids[best.indices.flatten()]
        order = candidates.argsort(descending=True)  # likeliest first: children in that order
        first_node, id_list, values = len(tokens), ids.tolist(), candidates.tolist()
        for index in order.tolist():  # plain lists: a tensor index per candidate costs more than the layer
            tokens.append(id_list[index])
            parents.append(rows_node[index // top_k])
            scores.append(values[index])
        if level == levels - 1:
            break
        expand = order[:top_k]  # the next level's rows: the likeliest candidates
        rows = expand // top_k
        states, cache[:] = states[rows], [part[rows] for part in cache]
        feed, path_scores = ids[expand], candidates[expand]
        rows_node = [first_node + position for position in range(len(expand))]
    floor = math.log(min_probability) if min_probability > 0 else -math.inf
    return _likeliest(tokens, parents, scores, max_nodes, floor)


def _likeliest(tokens: list[int], parents: list[int], scores: list[float], max_nodes: int, floor: float) -> DraftTree:
    """The `max_nodes` likeliest nodes scoring at least `floor`, with all their ancestors, in
    their original order."""
    kept: set[int] = set()
    for node in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        if scores[node] < floor:
            break
        chain = []
        while node >= 0 and node not in kept:
            chain.append(node)
            node = parents[node]
        if len(kept) + len(chain) > max_nodes:
            break
        kept.update(chain)
    index = {old: new for new, old in enumerate(sorted(kept))}
    ordered = sorted(kept)
    return DraftTree(tuple(tokens[i] for i in ordered), tuple(index.get(parents[i], -1) for i in ordered))
