"""Drafts as token trees: candidates that share a prefix, verified together in one target step.

A `DraftTree` lists its tokens in topological order, each with its parent's index (-1: a child of
the request's newest token). A chain of drafts is the tree whose every parent is the node before.
Fed after the newest token, node i sits at feed index i + 1, in the cache slot after it, at the
sequence position of its depth, and sees its ancestors (`kiln.backends.token_trees`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def of_continuations(cls, continuations: Sequence[Sequence[int]], max_nodes: int) -> DraftTree:
        """The trie of `continuations` (the first ones first), at most `max_nodes` nodes."""
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for continuation in continuations:
            at = -1
            for token in continuation:
                key = (at, int(token))
                if key not in child:
                    if len(tokens) == max_nodes:
                        break
                    child[key] = len(tokens)
                    tokens.append(int(token))
                    parents.append(at)
                at = child[key]
        return cls(tuple(tokens), tuple(parents))

    @classmethod
    def merged(cls, trees: Sequence[DraftTree], max_nodes: int) -> tuple[DraftTree, list[int]]:
        """One tree holding the nodes of `trees` (the first ones first, each in its own order) with
        their shared prefixes stored once, at most `max_nodes` nodes (a node past the budget drops
        with its descendants), and for each node a bit mask of the trees it came from (bit i: the
        i-th tree)."""
        tokens: list[int] = []
        parents: list[int] = []
        sources: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for bit, tree in enumerate(trees):
            placed: dict[int, int] = {-1: -1}  # the tree's node -> the merged node
            for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
                if parent not in placed:
                    continue
                key = (placed[parent], token)
                if key not in child:
                    if len(tokens) == max_nodes:
                        continue
                    child[key] = len(tokens)
                    tokens.append(token)
                    parents.append(placed[parent])
                    sources.append(0)
                placed[node] = child[key]
                sources[child[key]] |= 1 << bit
        return cls(tuple(tokens), tuple(parents)), sources

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the newest token."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 + (depths[parent] if parent >= 0 else 0))
        return depths

    def first_path(self) -> list[int]:
        """The tokens of the path that always takes the first child (the drafter's best guess)."""
        path, at = [], -1
        while children := self.children(at):
            at = children[0]
            path.append(self.tokens[at])
        return path

    def within(self, vocab_size: int | None, max_nodes: int) -> DraftTree:
        """The first `max_nodes` nodes, without ids the model lacks (nor their descendants)."""
        kept: dict[int, int] = {-1: -1}
        tokens, parents = [], []
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if len(tokens) == max_nodes:
                break
            if parent in kept and (vocab_size is None or 0 <= token < vocab_size):
                kept[i] = len(tokens)
                tokens.append(token)
                parents.append(kept[parent])
        return DraftTree(tuple(tokens), tuple(parents))

    def visibility(self) -> torch.Tensor:
        """bool [1 + n, 1 + n] over the feed (the newest token, then the nodes): who sees whom."""
        size = 1 + len(self)
        seen = torch.zeros(size, size, dtype=torch.bool)
        seen[:, 0] = True
        for i, parent in enumerate(self.parents):
            seen[i + 1] = seen[parent + 1]
            seen[i + 1, i + 1] = True
        return seen
