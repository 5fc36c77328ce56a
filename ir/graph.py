"""The IR's data structures: `Value`s in SSA form produced by `Node`s inside a `Graph`.

Weights are graph parameters: typed values whose tensors live out of line in `Graph.weights`,
so the text form stays small and passes can rewrite weights without touching the listing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .dims import SymbolBound, is_dim, normalize
from .dtypes import from_torch
from .tensor_type import TensorType


@dataclass(eq=False)
class Value:
    """An SSA value: defined once (graph input, parameter or node output), typed."""

    name: str
    type: TensorType
    producer: "Node | None" = None

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Node:
    """One op application. `inputs` may hold None for an omitted optional input."""

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
        self.nodes: list[Node] = []
        self.outputs: list[Value] = []
        self.symbols: dict[str, SymbolBound] = {}
        self.meta: dict[str, Any] = {}
        self._names: set[str] = set()
        self._counter = itertools.count()

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
        node = self.create(op, inputs, attrs, [name] if name else None)
        self.nodes.append(node)
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)

    # -- editing ------------------------------------------------------------------------
    def users(self) -> dict[Value, list[Node]]:
        """Map from each value to the nodes that read it."""
        result: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for v in node.inputs:
                if v is not None:
                    result.setdefault(v, []).append(node)
        return result

    def replace_all_uses(self, old: Value, new: Value) -> None:
        for node in self.nodes:
            node.inputs = [new if v is old else v for v in node.inputs]
        self.outputs = [new if v is old else v for v in self.outputs]

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
