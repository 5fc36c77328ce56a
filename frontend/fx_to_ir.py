"""Convert a `torch.export` program (training IR, or core ATen after decomposition) into Kiln IR.

Each FX node is handled by the ATen table in `aten_table.py`. Nodes whose value is a SymInt
(`sym_size`, arithmetic on sizes) become symbolic dims, not IR values: Kiln keeps sizes in
types and attributes, so `view(x, [s0, s1, -1, 16])` becomes `reshape {shape=[batch, seq, 4, 16]}`.
"""

from __future__ import annotations

import re
from typing import Any

import sympy
import torch
import torch.fx

from kiln.ir import Graph, TensorType, Value, from_torch, symbol
from kiln.ir.dims import dims_equal, normalize

from .errors import KilnError, UnsupportedOpError


class ConversionError(KilnError, RuntimeError):
    """A mapped ATen op produced an IR type that disagrees with what torch.export recorded."""


def source_line(node: torch.fx.Node) -> str | None:
    """`file.py:line` of the innermost frame in the FX node's stack trace (the model's code)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


class FxToIr:
    """The state of one conversion: the IR graph being built and the FX -> IR value map."""

    def __init__(self, program: torch.export.ExportedProgram, input_names: list[str], dim_names: dict, layers=None):
        self.program = program
        self.layers = layers  # a layer_templates.LayerPlan: tag each IR node with its layer
        if layers is not None:
            layers.tags.clear()
        self.graph = Graph()
        self.env: dict[torch.fx.Node, Any] = {}
        self.input_names = input_names
        self.dim_names = dim_names  # user-facing name per (input index, axis)
        self.symbol_map: dict[sympy.Symbol, sympy.Symbol] = {}
        self.current: torch.fx.Node | None = None

    # -- values and dims ----------------------------------------------------------------
    def dim(self, x) -> Any:
        """A torch size (int or SymInt) as an IR dim."""
        if isinstance(x, torch.fx.Node):
            x = self.env[x]
            return x
        if isinstance(x, torch.SymInt):
            expr = _resolve_min_max(x.node.expr, x.node.shape_env)
            return normalize(expr.xreplace(self.symbol_map))
        if isinstance(x, int):
            return x
        raise ConversionError(f"not a size: {x!r}")

    def type_of(self, fx_node: torch.fx.Node) -> TensorType:
        val = fx_node.meta["val"]
        return TensorType(from_torch(val.dtype), tuple(self.dim(d) for d in val.shape))

    def value(self, arg) -> Value:
        """The IR value of an FX tensor argument."""
        v = self.env.get(arg) if isinstance(arg, torch.fx.Node) else None
        if not isinstance(v, Value):
            raise ConversionError(f"expected a tensor argument, got {arg!r}")
        return v

    def constant(self, scalar, dtype: str) -> Value:
        """A rank-0 constant tensor (Kiln has no scalar operands; constants are `full` nodes)."""
        return self.graph.call("full", value=scalar, dtype=dtype)

    def operand(self, arg, other_dtype_like) -> Value:
        """A tensor argument, or a Python scalar made a constant of the op's dtype."""
        if isinstance(arg, torch.fx.Node):
            return self.value(arg)
        dtype = from_torch(torch.result_type(other_dtype_like, arg))
        return self.constant(arg, dtype)

    def call(self, op: str, *inputs, **attrs):
        return self.graph.call(op, *inputs, **attrs)

    def inline(self, body: torch.fx.Node, args) -> tuple:
        """Convert the submodule `body` (a get_attr of a higher-order op's region) in place, its
        placeholders bound to `args`; returns its outputs as a tuple."""
        module = getattr(self.program.graph_module, body.target)
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        for node, arg in zip(placeholders, args):
            self.env[node] = self.env[arg] if isinstance(arg, torch.fx.Node) else arg
        outer = self.current
        try:
            for node in module.graph.nodes:
                if node.op == "call_function":
                    self.convert_node(node)
                elif node.op == "output":
                    return tuple(self.env[a] if isinstance(a, torch.fx.Node) else a for a in node.args[0])
        finally:
            self.current = outer
        raise ConversionError(f"region {body.target} has no output")

    # -- the walk -----------------------------------------------------------------------
    def add_placeholders(self) -> None:
        sig = self.program.graph_signature
        weights = {**self.program.state_dict, **self.program.constants}
        param_of = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
        user_index = 0
        for node in self.program.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in param_of:
                target = param_of[node.name]
                tensor = weights[target].detach()
                name = _clean_param_name(target)
                name = self.layers.param_name(name) if self.layers else name
                self.env[node] = self.graph.add_param(name, tensor.contiguous())
            else:
                self._add_user_input(node, user_index)
                user_index += 1

    def _add_user_input(self, node: torch.fx.Node, index: int) -> None:
        val = node.meta["val"]
        for axis, d in enumerate(val.shape):
            if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                name = self.dim_names[(index, axis)]
                self.symbol_map.setdefault(d.node.expr, symbol(name))
        self.env[node] = self.graph.add_input(self.input_names[index], self.type_of(node))

    def convert_node(self, node: torch.fx.Node) -> None:
        from .aten_table import ATEN_TO_IR

        self.current = node
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool) and node.op == "call_function":
            self.env[node] = self.dim(val)  # a size computation: becomes a symbolic dim
            return
        if isinstance(val, (torch.SymBool, bool)) and node.op == "call_function":
            self.env[node] = None  # a guard's condition: it feeds an assert, which the IR drops
            return
        handler = ATEN_TO_IR.get(node.target)
        if handler is None:
            raise UnsupportedOpError.in_capture(_op_name(node.target), _arg_shapes(node), source_line(node))
        try:
            result = handler(self, *node.args, **node.kwargs)
        except NotImplementedError as e:
            raise UnsupportedOpError.in_capture(
                f"{_op_name(node.target)} ({e})", _arg_shapes(node), source_line(node)
            ) from None
        self.env[node] = result
        line = source_line(node)
        if isinstance(result, Value) and line is not None:
            self.graph.source_lines.setdefault(result, line)
        if isinstance(result, Value) and isinstance(val, torch.Tensor):
            self._check_type(node, result)

    def _check_type(self, node: torch.fx.Node, result: Value) -> None:
        expected = self.type_of(node)
        same = (
            expected.dtype == result.type.dtype
            and expected.rank == result.type.rank
            and all(dims_equal(a, b) for a, b in zip(expected.shape, result.type.shape))
        )
        if not same:
            raise ConversionError(
                f"{_op_name(node.target)} at {source_line(node)} converted to {result.type}, "
                f"but torch.export recorded {expected}"
            )

    def convert(self, output_names: list[str]) -> Graph:
        self.add_placeholders()
        for node in self.program.graph.nodes:
            if node.op == "call_function":
                start = len(self.graph.nodes)
                self.convert_node(node)
                if self.layers is not None:
                    layer = self.layers.layer_of(node)
                    self.layers.tags.update((id(n), layer) for n in self.graph.nodes[start:])
            elif node.op == "output":
                outputs = [self.value(a) for a in node.args[0]]
        self.graph.outputs = [self._rename(v, n) for v, n in zip(outputs, output_names)]
        return self.graph

    def _rename(self, value: Value, name: str) -> Value:
        """Give a graph output a stable name (a no-op reshape would be noise: rename in place)."""
        if value.producer is not None:
            self.graph.rename(value, name)
        return value


def _resolve_min_max(expr: sympy.Expr, shape_env) -> sympy.Expr:
    """Max/Min whose winner the symbols' bounds decide, replaced by it: MPT slices its ALiBi table
    `[max(0, n - seq):]`, which is `n - seq` for every seq the capture allows."""
    from torch.utils._sympy.functions import Max, Min

    def pick(node):
        is_max = isinstance(node, (sympy.Max, Max))
        first, *rest = node.args
        for other in rest:
            gap = shape_env.bound_sympy(first - other)
            first_wins = gap.lower >= 0 if is_max else gap.upper <= 0
            other_wins = gap.upper <= 0 if is_max else gap.lower >= 0
            if not (first_wins or other_wins):
                return node
            first = first if first_wins else other
        return first

    return expr.replace(lambda e: isinstance(e, (sympy.Max, sympy.Min, Max, Min)), pick)


def _clean_param_name(name: str) -> str:
    """`lm.model.layers.0.q_proj.weight` -> `model.layers.0.q_proj.weight` (drop the wrapper)."""
    return re.sub(r"[^\w.\-]", "_", name.removeprefix("lm."))


def _op_name(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def _arg_shapes(node: torch.fx.Node) -> list:
    shapes = []
    for a in node.args:
        val = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        shapes.append(list(val.shape) if isinstance(val, torch.Tensor) else repr(a))
    return shapes
