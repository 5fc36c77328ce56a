"""Run a Kiln graph on tinygrad Tensors: each node becomes lazy Tensor operations.

`graph_to_tensors` walks the nodes in order with `LoweringContext` (the symbol bindings, the
per-row start variables, the caches the executable owns) and returns the graph outputs as
Tensors. Called inside a `TinyJit` function, it is traced once per specialization and never
again: replays run the captured kernels.
"""

from __future__ import annotations

from collections.abc import Mapping

from tinygrad import Tensor

from kiln.ir import Graph, Value

from .op_lowerings import lower_node, tiny_dtype
from .symbolic_dims import to_attr
from .weight_layouts import WeightLayouts


class LoweringContext:
    """What the lowerings need beyond their inputs: sizes, start variables, cache ownership."""

    def __init__(
        self,
        bindings: dict,
        starts: list | None = None,
        owned_caches: frozenset[str] = frozenset(),
        layouts: WeightLayouts | None = None,
        last=None,
        logits: Value | None = None,
    ):
        self.bindings = bindings
        self.starts = starts  # one bound Variable per batch row, or None (generic cache ops)
        self.owned_caches = owned_caches
        self.layouts = layouts or WeightLayouts({})
        self._written: set[int] = set()
        self.last, self.logits = last, logits  # a last_only step's bound index, and the value it selects from
        self.selected_last = False

    def last_rows(self, node, x: Tensor) -> Tensor:
        """x [batch, seq, K] at the last_only index when `node` is the product making the graph's
        logits (the lm_head): the product then runs for that position alone, as a decode step's
        (over packed codes, their grouped form rather than a prefill matmul over every position)."""
        if self.last is None or node.outputs[0] is not self.logits or x.ndim != 3:
            return x
        self.selected_last = True
        return x[:, self.last : self.last + 1]

    def owns_cache(self, value: Value) -> bool:
        """Is `value` a graph input whose buffer the executable owns (written in place)?"""
        return value.producer is None and value.name in self.owned_caches

    def mark_written_in_place(self, value: Value) -> None:
        self._written.add(id(value))

    def written_in_place(self, value: Value | None) -> bool:
        return value is not None and id(value) in self._written

    def linear(self, node, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """x @ weight.T + bias, reading the weight in the layout prepared for it."""
        x = self.last_rows(node, x)
        y = self.layouts.linear(node.inputs[1], x, weight, node.outputs[0].type.shape[-1])
        return y + bias if bias is not None else y

    def matmul(self, node, a: Tensor, b: Tensor) -> Tensor:
        """a @ b, reading a weight b in the layout prepared for it."""
        return self.layouts.matmul(node.inputs[1], a, b)

    def embedding(self, node, weight: Tensor, ids: Tensor) -> Tensor:
        """weight[ids] (rows gathered by integer ids of any shape), in the weight's stored layout."""
        return self.layouts.embedding(node.inputs[0], weight, ids)


def graph_to_tensors(graph: Graph, tensors: Mapping[str, Tensor], ctx: LoweringContext) -> list[Tensor]:
    """The graph's outputs as lazy Tensors; `tensors` gives every input and parameter by name."""
    env: dict[int, Tensor] = {}
    for v in [*graph.inputs, *graph.params.values()]:
        env[id(v)] = tensors[v.name]
    for node in graph.nodes:
        args = [None if v is None else env[id(v)] for v in node.inputs]
        attrs = {k: to_attr(a, ctx.bindings) for k, a in node.attrs.items()}
        result = lower_node(ctx, node, args, attrs)
        results = result if isinstance(result, tuple) else (result,)
        for value, tensor in zip(node.outputs, results):
            dtype = tiny_dtype(value.type.dtype)
            env[id(value)] = tensor if tensor.dtype == dtype else tensor.cast(dtype)
    return [env[id(v)] for v in graph.outputs]
