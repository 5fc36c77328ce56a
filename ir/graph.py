"""The IR's data structures: `Value`s in SSA form produced by `Node`s inside a `Graph`.

Weights are graph parameters: typed values whose tensors live out of line in `Graph.weights`,
so the text form stays small and passes can rewrite weights without touching the listing.

The Graph owns its edits, as torch.fx's does: passes create nodes with `create`, place them with
`append` / `insert_before` / `insert_after`, rewire with `replace_all_uses` / `set_input`, and
remove them with `erase` (which refuses a node something still reads). Each value knows the
node making it (`producer`) and the nodes reading it (`users`), both kept current by those edits.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .dims import SymbolBound, is_dim, normalize
from .dtypes import from_torch
from .errors import KilnError
from .node_list import NodeList, drop_use
from .tensor_type import TensorType


class GraphEditError(KilnError, ValueError):
    """An edit would break the graph (erasing a node that is still read, placing a node twice)."""


@dataclass(eq=False)
class Value:
    """An SSA value: defined once (graph input, parameter or node output), typed.

    `users`: the graph's nodes reading this value, one entry per read (a node reading it twice is
    listed twice), in the order the reads were made; graph outputs are not users."""

    name: str
    type: TensorType
    producer: Node | None = None
    users: list[Node] = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Node:
    """One op application. `inputs` may hold None for an omitted optional input; change them
    through `Graph.set_input` / `Graph.replace_all_uses`, which keep the values' `users` current."""

    op: str
    inputs: list[Value | None]
    attrs: dict[str, Any]
    outputs: list[Value] = field(default_factory=list)

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"{self.op} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def __repr__(self) -> str:
        from .printer import format_node

        return format_node(self)


def freeze_attr(v):
    """Attributes are immutable: lists become tuples, dims are normalized."""
    if isinstance(v, (list, tuple)):
        return tuple(freeze_attr(x) for x in v)
    if is_dim(v) and not isinstance(v, int):
        return normalize(v)
    return v


class Graph:
    """Ordered nodes, named inputs/outputs, out-of-line parameters, symbols and metadata."""

    def __init__(self):
        self.inputs: list[Value] = []
        self.params: dict[str, Value] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self._nodes = NodeList()
        self.outputs: list[Value] = []
        self.symbols: dict[str, SymbolBound] = {}
        self.meta: dict[str, Any] = {}
        # value -> "file.py:line" of the model code that computed it, where capture knew it (for
        # errors raised by later passes; not part of the graph's text form)
        self.source_lines: weakref.WeakKeyDictionary[Value, str] = weakref.WeakKeyDictionary()
        self._names: set[str] = set()
        self._counter = itertools.count()

    @property
    def nodes(self) -> NodeList:
        """The nodes in order. Read it freely; edit through the methods below."""
        return self._nodes

    @nodes.setter
    def nodes(self, nodes) -> None:
        self._nodes[:] = list(nodes)

    # -- building -----------------------------------------------------------------------
    def fresh_name(self, hint: str | None = None) -> str:
        if hint and hint not in self._names:
            return hint
        while True:
            name = f"{hint}.{next(self._counter)}" if hint else str(next(self._counter))
            if name not in self._names:
                return name

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"value name %{name} is already defined")
        self._names.add(name)
        return name

    def add_symbol(self, name: str, min: int, max: int) -> None:
        self.symbols[name] = SymbolBound(name, min, max)

    def add_input(self, name: str, type: TensorType) -> Value:
        value = Value(self._claim(name), type)
        self.inputs.append(value)
        return value

    def add_param(self, name: str, tensor: torch.Tensor | None = None, type: TensorType | None = None) -> Value:
        """A weight. Give the tensor (type derived) or only the type (tensor attached later)."""
        if type is None:
            type = TensorType(from_torch(tensor.dtype), tuple(tensor.shape))
        value = Value(self._claim(name), type)
        self.params[name] = value
        if tensor is not None:
            self.weights[name] = tensor
        return value

    def make_node(self, op: str, inputs, attrs: dict, output_types: list[TensorType], names=None) -> Node:
        """Create (not insert) a node with given output types."""
        node = Node(op, list(inputs), {k: freeze_attr(v) for k, v in attrs.items()})
        names = names or [None] * len(output_types)
        node.outputs = [Value(self._claim(self.fresh_name(n)), t, node) for n, t in zip(names, output_types)]
        return node

    def create(self, op: str, inputs, attrs: dict | None = None, names=None) -> Node:
        """Create (not insert) a node, inferring its output types from the op's rule."""
        from .registry import get_op

        opdef = get_op(op)
        attrs = opdef.complete_attrs(attrs or {})
        inputs = list(inputs)
        if not opdef.variadic:  # omitted trailing optional inputs are explicit Nones
            inputs += [None] * (len(opdef.inputs) - len(inputs))
        types = opdef.infer_types([i.type if i is not None else None for i in inputs], attrs)
        return self.make_node(op, inputs, attrs, types, names)

    def call(self, op: str, *inputs, name: str | None = None, **attrs):
        """Append a node; returns its output Value (or a tuple for multi-output ops)."""
        node = self.append(self.create(op, inputs, attrs, [name] if name else None))
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)

    # -- editing ------------------------------------------------------------------------
    def append(self, node: Node) -> Node:
        """Put a created node at the end of the graph; returns it."""
        self._insert(len(self._nodes), [node])
        return node

    def insert_before(self, anchor: Node, *nodes: Node) -> None:
        """Put created nodes, in order, just before `anchor`."""
        self._insert(self._anchor_position(anchor), nodes)

    def insert_after(self, anchor: Node, *nodes: Node) -> None:
        """Put created nodes, in order, just after `anchor`."""
        self._insert(self._anchor_position(anchor) + 1, nodes)

    def _anchor_position(self, anchor: Node) -> int:
        if anchor not in self._nodes:
            raise GraphEditError(f"node `{anchor}` is not in the graph. Fix: insert next to a node of the graph")
        return self.position(anchor)

    def _insert(self, at: int, nodes) -> None:
        try:
            self._nodes[at:at] = nodes
        except ValueError as e:  # a node is in the graph already
            raise GraphEditError(f"{e}. Fix: insert each node made by graph.create once") from None

    def erase(self, *nodes: Node) -> None:
        """Remove nodes whose outputs nothing outside them reads, releasing their names. Raises
        GraphEditError naming a reader (or a graph output) otherwise."""
        gone = {id(n) for n in nodes}
        for node in nodes:
            for v in node.outputs:
                reader = next((u for u in v.users if id(u) not in gone), None)
                if reader is not None or self.is_output(v):
                    what = f"read by `{reader}`" if reader is not None else "a graph output"
                    raise GraphEditError(
                        f"cannot erase `{node}`: %{v.name} is still {what}. "
                        "Fix: replace its uses first (graph.replace_all_uses)"
                    )
        self._nodes.remove_all(list(nodes))
        for node in nodes:
            self.forget_names(node)

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Point every read of `old` (graph outputs included) at `new`. A graph output keeps its
        name: when `old` is one and `new` is a node's result not yet an output, the two values
        swap names (both stay claimed; erasing old's node releases the name new had)."""
        if old is new:
            return
        for node in {id(u): u for u in old.users}.values():
            node.inputs = [new if v is old else v for v in node.inputs]
        new.users += old.users
        old.users.clear()
        if self.is_output(old):
            if new.producer is not None and not self.is_output(new):
                old.name, new.name = new.name, old.name
            self.outputs = [new if v is old else v for v in self.outputs]

    def set_input(self, node: Node, index: int, value: Value | None) -> None:
        """Make `node` read `value` as its input `index`."""
        old = node.inputs[index]
        node.inputs[index] = value
        if node in self._nodes:
            if old is not None:
                drop_use(old.users, node)
            if value is not None:
                value.users.append(node)

    def rename(self, value: Value, name: str) -> None:
        """Give `value` the name `name` (which must be free), releasing its old one."""
        if name == value.name:
            return
        if name in self._names:
            raise GraphEditError(
                f"cannot rename %{value.name} to %{name}: the name is taken. Fix: pick a free one (graph.fresh_name)"
            )
        self._claim(name)
        self._names.discard(value.name)
        value.name = name

    def is_output(self, value: Value) -> bool:
        return any(v is value for v in self.outputs)

    def position(self, node: Node) -> int:
        """The node's index in `nodes`, for ordering nodes (cached until the nodes change)."""
        return self._nodes.position(node)

    def remove_param(self, name: str) -> None:
        del self.params[name]
        self.weights.pop(name, None)
        self._names.discard(name)

    def forget_names(self, node: Node) -> None:
        """Release the names of a removed node's outputs."""
        for v in node.outputs:
            self._names.discard(v.name)

    def values(self):
        """Every defined value in definition order."""
        yield from self.inputs
        yield from self.params.values()
        for node in self.nodes:
            yield from node.outputs

    def __str__(self) -> str:
        from .printer import print_graph

        return print_graph(self)
