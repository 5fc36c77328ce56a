"""`Graph.nodes`: the graph's nodes in order, a list that keeps every value's `users` current.

A node that enters the list is recorded in the `users` of each value it reads; one that leaves
is taken out again, whichever list operation moved it. So `value.users` is always the nodes of
the graph reading `value`, as `value.producer` is always the node making it, and no pass has to
recompute uses. Passes edit through the Graph's methods (`insert_before`, `erase`, ...); the
list operations are what those methods are built on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .graph import Node


def _add_uses(node: Node) -> None:
    for v in node.inputs:
        if v is not None:
            v.users.append(node)


def _drop_uses(node: Node) -> None:
    for v in node.inputs:
        if v is not None:
            drop_use(v.users, node)


def drop_use(users: list, node: Node) -> None:
    """Remove one entry of `node` from a `users` list (by identity; absent: nothing to do)."""
    for i, user in enumerate(users):
        if user is node:
            del users[i]
            return


class NodeList(list):
    """The graph's nodes, in order. Membership and positions are answered in constant time."""

    def __init__(self, nodes: Iterable[Node] = ()):
        super().__init__()
        self._members: set[int] = set()
        self._positions: dict[int, int] | None = None
        self.extend(nodes)

    # -- queries ----------------------------------------------------------------------------
    def __contains__(self, node) -> bool:
        return id(node) in self._members

    def position(self, node: Node) -> int:
        """The node's index in the list (cached until the list changes)."""
        if self._positions is None:
            self._positions = {id(n): i for i, n in enumerate(self)}
        try:
            return self._positions[id(node)]
        except KeyError:
            raise ValueError(f"node `{node}` is not in the graph") from None

    def index(self, node, *args) -> int:
        return self.position(node) if not args and node in self else super().index(node, *args)

    # -- bookkeeping ------------------------------------------------------------------------
    def _enter(self, nodes: list[Node]) -> None:
        ids = [id(n) for n in nodes]
        if len(set(ids)) != len(ids) or not self._members.isdisjoint(ids):
            twice = next(n for n in nodes if id(n) in self._members or ids.count(id(n)) > 1)
            raise ValueError(f"node `{twice}` would be in the graph twice")
        self._members.update(ids)
        for node in nodes:
            _add_uses(node)
        self._positions = None

    def _leave(self, nodes: list[Node]) -> None:
        for node in nodes:
            self._members.discard(id(node))
            _drop_uses(node)
        self._positions = None

    def remove_all(self, nodes: list[Node]) -> None:
        """Take `nodes` out in one sweep (their uses dropped)."""
        gone = {id(n) for n in nodes}
        super().__setitem__(slice(None), [n for n in self if id(n) not in gone])
        self._leave([n for n in nodes if id(n) in self._members])

    def reread(self, node: Node, old_inputs: list) -> None:
        """`node` (in the list) now reads `node.inputs` instead of `old_inputs`: move its uses."""
        if node in self:
            for v in old_inputs:
                if v is not None:
                    drop_use(v.users, node)
            _add_uses(node)

    # -- list operations, each keeping the uses ---------------------------------------------
    def append(self, node: Node) -> None:
        self._enter([node])
        super().append(node)

    def extend(self, nodes: Iterable[Node]) -> None:
        nodes = list(nodes)
        self._enter(nodes)
        super().extend(nodes)

    def __iadd__(self, nodes: Iterable[Node]):
        self.extend(nodes)
        return self

    def insert(self, index: int, node: Node) -> None:
        self._enter([node])
        super().insert(index, node)

    def pop(self, index: int = -1) -> Node:
        node = super().pop(index)
        self._leave([node])
        return node

    def remove(self, node: Node) -> None:
        super().__delitem__(self.index(node))
        self._leave([node])

    def clear(self) -> None:
        self._leave(list(self))
        super().clear()

    def __setitem__(self, key, value) -> None:
        old = self[key] if isinstance(key, slice) else [self[key]]
        new = list(value) if isinstance(key, slice) else [value]
        self._leave(old)
        try:
            self._enter(new)
        except ValueError:
            self._enter(old)
            raise
        super().__setitem__(key, value if not isinstance(key, slice) else new)

    def __delitem__(self, key) -> None:
        old = self[key] if isinstance(key, slice) else [self[key]]
        super().__delitem__(key)
        self._leave(old)

    def __imul__(self, n):
        raise TypeError("a graph's nodes cannot be repeated")

    def sort(self, *args, **kwargs) -> None:
        super().sort(*args, **kwargs)
        self._positions = None

    def reverse(self) -> None:
        super().reverse()
        self._positions = None
