"""Kiln IR -> `torch.fx.GraphModule`, one IR op to one torch call.

`FX_LOWERINGS` is the one table from IR op name to lowering; every op in the IR registry has an
entry (`check_lowering_table` says which do not). The module it builds:
- holds the graph's weights as parameters (requires_grad False) and the `state` inputs (the KV
  caches) as buffers, which `kv_write` updates in place;
- takes the other graph inputs positionally and returns, as a tuple, the graph outputs that are
  not state (for the stateful LLM graph: `(logits,)`);
- reads symbolic sizes at run time: a symbol that is a bare dim of an input becomes
  `input.size(axis)`, and an attribute such as `shape=[batch, seq, 4, 16]` or `end=seq+past`
  becomes arithmetic on those sizes, so one traced module serves every batch and length.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from kiln.backends.errors import LoweringError
from kiln.ir import Graph, Node, all_ops, ops_with, to_torch
from kiln.ir.errors import UnsupportedOpError
from kiln.ir.ops.paged_kv import kv_pages_reference, paged_write_index

from . import composite_ops
from .collectives import COLLECTIVE_LOWERINGS
from .quantized_linear import QUANTIZED_LOWERINGS


class FxBuilder:
    """An fx.Graph being built, with the runtime value of each IR symbol, for `device` ("cpu" or
    "cuda[:N]", where tensors the graph makes live): lowerings to Kiln's CPU kernels decline when
    the lowerings are chosen for another device (`on_cpu` False; `lowering_for` says which)."""

    def __init__(self, device: str = "cpu", lowering_for: str | None = None):
        self.device = device
        self.on_cpu = (lowering_for or device) == "cpu"
        self.graph = fx.Graph()
        self.root = torch.nn.Module()  # owns the parameters and buffers that get_attr nodes read
        self._taken: set[str] = set()
        self.buffers: set[str] = set()  # attribute names of the mutable state (KV caches)
        # symbol name -> its size: an int, or (input node, axis) read on first use
        self.symbols: dict[str, int | tuple[fx.Node, int]] = {}
        self._dims: dict[sympy.Expr, fx.Node | int] = {}
        self._shared: dict[tuple, fx.Node] = {}

    def shared(self, key: tuple, make: Callable[[], fx.Node]) -> fx.Node:
        """The node `make()` builds, built once per key: work every layer repeats (rope's table
        rows, kv_write's index) is emitted once, which keeps the graph Inductor compiles small."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def call(self, fn: Callable, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(fn, args, kwargs)

    def method(self, name: str, *args, **kwargs) -> fx.Node:
        return self.graph.call_method(name, args, kwargs)

    def add_input(self, ir_name: str) -> fx.Node:
        """A positional input of the module's forward."""
        return self.graph.placeholder(attribute_name(ir_name, "", self._taken))

    def add_constant(self, ir_name: str, tensor: torch.Tensor, prefix: str = "param_") -> fx.Node:
        """A tensor held by the module as a parameter (no grad), read by a get_attr node."""
        name = attribute_name(ir_name, prefix, self._taken)
        self.root.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        return self.graph.get_attr(name)

    def add_buffer(self, ir_name: str, tensor: torch.Tensor) -> fx.Node:
        """A tensor the module owns and mutates (a KV cache), read by a get_attr node."""
        name = attribute_name(ir_name, "state_", self._taken)
        self.root.register_buffer(name, tensor)
        self.buffers.add(name)
        return self.graph.get_attr(name)

    def constant(self, node: fx.Node) -> torch.Tensor | None:
        """The tensor behind a get_attr node (a weight or buffer), else None."""
        return getattr(self.root, node.target) if node.op == "get_attr" else None

    def dim(self, d) -> fx.Node | int:
        """A (symbolic) dim as an int or an fx node computing it from the inputs' sizes."""
        if isinstance(d, int):
            return d
        if d.is_Integer:
            return int(d)
        if d not in self._dims:
            self._dims[d] = self._emit_dim(d)
        return self._dims[d]

    def _emit_dim(self, d: sympy.Expr) -> fx.Node | int:
        if isinstance(d, sympy.Symbol):
            if d.name not in self.symbols:
                raise LoweringError(
                    f"symbol {d.name} is not the bare dim of any graph input, so its runtime "
                    f"value is unknown; give some input a dim of exactly {d.name}"
                )
            size = self.symbols[d.name]
            return size if isinstance(size, int) else self.method("size", *size)
        if isinstance(d, (sympy.Add, sympy.Mul)):
            fn = operator.add if isinstance(d, sympy.Add) else operator.mul
            coeff, terms = d.as_coeff_add() if fn is operator.add else d.as_coeff_mul()
            if not coeff.is_Integer:
                raise LoweringError(f"dim {d} has a non-integer coefficient")
            result = self.dim(terms[0])
            for term in terms[1:]:
                result = self.call(fn, result, self.dim(term))
            if coeff != (0 if fn is operator.add else 1):
                result = self.call(fn, result, int(coeff))
            return result
        if isinstance(d, sympy.Pow) and d.exp.is_Integer and d.exp > 0:
            base = self.dim(d.base)
            result = base
            for _ in range(int(d.exp) - 1):
                result = self.call(operator.mul, result, base)
            return result
        if isinstance(d, (sympy.floor, sympy.ceiling)):  # floor(a * p/q): integer division
            numerator, denominator = sympy.fraction(sympy.together(d.args[0]))
            if not denominator.is_Integer:
                raise LoweringError(f"dim {d} divides by a non-constant")
            num = self.dim(sympy.expand(numerator))
            if isinstance(d, sympy.ceiling):
                return self.call(
                    operator.neg, self.call(operator.floordiv, self.call(operator.neg, num), int(denominator))
                )
            return self.call(operator.floordiv, num, int(denominator))
        if isinstance(d, sympy.Mod) and d.args[1].is_Integer:
            return self.call(operator.mod, self.dim(d.args[0]), int(d.args[1]))
        raise LoweringError(f"dim expression {d} has no lowering (supported: + * ** floor ceiling mod)")

    def attr(self, value):
        """An attribute with every sympy dim replaced by its runtime value."""
        if isinstance(value, tuple):
            return tuple(self.attr(v) for v in value)
        if isinstance(value, sympy.Expr):
            return self.dim(value)
        return value


# A lowering gets the builder, the IR node, its inputs as fx nodes (None where omitted) and its
# attributes with dims made runtime values; it returns the fx node of the op's output.
Lowering = Callable[[FxBuilder, Node, list, dict], fx.Node]


def _torch_call(fn: Callable, **rename: str) -> Lowering:
    """Lowering to `fn(*inputs, **attrs)`, attribute names renamed to fn's keywords."""

    def lower(b, node, args, attrs):
        return b.call(fn, *args, **{rename.get(k, k): v for k, v in attrs.items()})

    return lower


def _same_named_function(op: str) -> Callable:
    """torch's function named like the op (torch.nn.functional's for silu, gelu)."""
    return getattr(torch, op, None) or getattr(F, op)


def _reduction(fn: Callable) -> Lowering:
    def lower(b, node, args, attrs):
        return b.call(fn, args[0], dim=list(attrs["axes"]), keepdim=attrs["keepdim"])

    return lower


def _slice(b, node, args, attrs):
    axis = attrs["axis"] % node.inputs[0].type.rank
    index = (slice(None),) * axis + (slice(attrs["start"], attrs["end"], attrs["step"]),)
    return b.call(operator.getitem, args[0], index)


def _layer_norm(b, node, args, attrs):
    normalized = (b.dim(node.inputs[0].type.shape[-1]),)
    return b.call(F.layer_norm, args[0], normalized, args[1], args[2], attrs["eps"])


# The hook for faster linear kernels (e.g. torch.ops.kiln.linear_f32 from gemv_kernel.py): each
# registered lowering is tried in turn and may decline a node by returning None; F.linear is
# the fallback. Such a lowering can repack a weight once at lowering time:
#     w = b.constant(args[1]); packed = b.add_constant(node.inputs[1].name + ".packed", pack(w))
#     return b.call(torch.ops.kiln.linear_f32, args[0], packed, args[2])
# (the unpacked weight then has no user and is left out of the module). The kernel must be a
# torch custom op with a fake implementation so that Dynamo, export and Inductor can trace it.
LINEAR_LOWERINGS: list[Lowering] = []


def register_linear_lowering(lowering: Lowering) -> None:
    """Try `lowering(b, node, args, attrs)` for `linear` nodes before the others (None declines)."""
    LINEAR_LOWERINGS.insert(0, lowering)


def _linear(b, node, args, attrs):
    return _first_taken(LINEAR_LOWERINGS, b, node, args, attrs) or b.call(F.linear, *args)


def _first_taken(lowerings: list[Lowering], b, node, args, attrs) -> fx.Node | None:
    """The result of the first registered lowering that does not decline (return None)."""
    for lowering in lowerings:
        result = lowering(b, node, args, attrs)
        if result is not None:
            return result
    return None


ATTENTION_LOWERINGS: list[Lowering] = []  # tried first, newest first; None declines


def register_attention_lowering(lowering: Lowering) -> None:
    """Try `lowering(b, node, args, attrs)` for `attention` nodes before the composite one."""
    ATTENTION_LOWERINGS.insert(0, lowering)


def _attention(b, node, args, attrs):
    return _first_taken(ATTENTION_LOWERINGS, b, node, args, attrs) or b.call(composite_ops.attention, *args, **attrs)


def _kv_write(b, node, args, attrs):
    if args[0].op == "get_attr" and args[0].target in b.buffers:  # a cache this module owns: in place
        new_shape = node.inputs[1].type.shape
        if len(args) > 3 and args[3] is not None:  # a paged pool: through the block table
            block_size = node.inputs[0].type.shape[2]
            index = b.shared(
                ("kv_write_paged_index", new_shape[1], args[2], args[3], block_size),
                lambda: b.call(paged_write_index, args[1], args[2], args[3], block_size),
            )
        else:
            index = b.shared(
                ("kv_write_index", new_shape[0], new_shape[1], args[2]),
                lambda: b.call(composite_ops.kv_write_index, args[1], args[2]),
            )
        return b.call(composite_ops.kv_write_at, args[0], args[1], index)
    return b.call(composite_ops.kv_write_functional, *args)


def _rope(b, node, args, attrs):
    x, positions, cos_table, sin_table = args
    rows = b.shared(
        ("rope_rows", positions, cos_table, sin_table),
        lambda: b.call(composite_ops.rope_rows, positions, cos_table, sin_table),
    )
    rotated = b.call(composite_ops.rotate_half, x, b.call(operator.getitem, rows, 0), b.call(operator.getitem, rows, 1))
    if node.inputs[2].type.dtype == node.inputs[0].type.dtype:
        return rotated
    return b.method("to", rotated, to_torch(node.inputs[0].type.dtype))


FX_LOWERINGS: dict[str, Lowering] = {
    **{name: _torch_call(_same_named_function(name)) for name in ops_with("elementwise") if name != "cast"},
    "cast": lambda b, node, args, attrs: b.method("to", args[0], to_torch(attrs["dtype"])),
    "matmul": _torch_call(torch.matmul),
    "sum": _reduction(torch.sum),
    "mean": _reduction(torch.mean),
    "max": _reduction(torch.amax),
    "any": lambda b, node, args, attrs: b.call(
        torch.any, b.method("bool", args[0]), dim=tuple(attrs["axes"]), keepdim=attrs["keepdim"]
    ),
    "cumsum": _torch_call(torch.cumsum, axis="dim"),
    "topk": _torch_call(torch.topk, axis="dim"),
    "softmax": _torch_call(torch.softmax, axis="dim"),
    "reshape": lambda b, node, args, attrs: b.method("reshape", args[0], attrs["shape"]),
    "permute": lambda b, node, args, attrs: b.method("permute", args[0], attrs["perm"]),
    "expand": lambda b, node, args, attrs: b.method("expand", args[0], attrs["shape"]),
    "slice": _slice,
    "concat": lambda b, node, args, attrs: b.call(torch.cat, list(args), dim=attrs["axis"]),
    "index": lambda b, node, args, attrs: b.call(operator.getitem, args[0], tuple(args[1:])),
    "arange": lambda b, node, args, attrs: b.call(
        torch.arange, attrs["start"], attrs["end"], attrs["step"], dtype=to_torch(attrs["dtype"]), device=b.device
    ),
    "full": lambda b, node, args, attrs: b.call(
        torch.full, attrs["shape"], attrs["value"], dtype=to_torch(attrs["dtype"]), device=b.device
    ),
    "linear": _linear,
    "embedding": lambda b, node, args, attrs: b.call(F.embedding, args[1], args[0]),
    "layer_norm": _layer_norm,
    "rms_norm": _torch_call(composite_ops.rms_norm),
    "add_rms_norm": _torch_call(composite_ops.add_rms_norm),
    "rope": _rope,
    "attention": _attention,
    "kv_write": _kv_write,
    "kv_pages": _torch_call(kv_pages_reference),
    "kv_quantize": _torch_call(composite_ops.kv_quantize),
    **QUANTIZED_LOWERINGS,  # linear_q, embedding_q (quantized_linear.py)
    **COLLECTIVE_LOWERINGS,  # all_reduce, all_gather (collectives.py)
}


def check_lowering_table() -> None:
    """Raise UnsupportedOpError naming every registered IR op that FX_LOWERINGS lacks."""
    missing = sorted(set(all_ops()) - set(FX_LOWERINGS))
    if missing:
        raise UnsupportedOpError(
            f"the inductor backend has no lowering for IR op(s) {missing}; "
            "add them to FX_LOWERINGS in backends/inductor/lower_to_fx.py"
        )


def attribute_name(ir_name: str, prefix: str, taken: set[str]) -> str:
    """A module attribute name for an IR value name (dots and symbols are not allowed in one)."""
    base = prefix + re.sub(r"\W", "_", ir_name)
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def _check_state_use(graph: Graph, state: Mapping[str, torch.Tensor]) -> None:
    """A state input is written in place, so only one kv_write may read it (as its cache)."""
    for v in graph.inputs:
        if v.name in state:
            readers = v.users
            if len(readers) != 1 or readers[0].op != "kv_write" or readers[0].inputs[0] is not v:
                raise LoweringError(
                    f"state input %{v.name} must be read by exactly one kv_write (as its "
                    f"cache); it is read by {[n.op for n in readers]}"
                )
            if graph.outputs and v in graph.outputs:
                raise LoweringError(f"state input %{v.name} is also a graph output")


def graph_to_fx(
    graph: Graph,
    weights: Mapping[str, torch.Tensor] | None = None,
    state: Mapping[str, torch.Tensor] | None = None,
    device: str = "cpu",
    lowering_for: str | None = None,
) -> fx.GraphModule:
    """Lower `graph` to an FX module. `state` maps graph input names to buffers the module owns.
    `device` is where the module will run: off the CPU, only torch's own ops are emitted (and
    the device's own forms of some, e.g. CUDA's int4 matmul: cuda_lowerings.py).
    `lowering_for` chooses the lowerings of another device than the one it runs on (tests run
    the CUDA lowering on the CPU).

    The module's `input_names` / `output_names` list the IR names of its positional inputs and of
    the outputs it returns (state outputs are left out: they live in the buffers).
    """
    check_lowering_table()
    weights = graph.weights if weights is None else weights
    state = dict(state or {})
    _check_state_use(graph, state)
    b = FxBuilder(device, lowering_for)
    env: dict[int, fx.Node] = {}
    input_names = []
    for v in graph.inputs:
        if v.name in state:
            env[id(v)] = b.add_buffer(v.name, state[v.name])
            sizes = list(state[v.name].shape)
        else:
            input_names.append(v.name)
            env[id(v)] = b.add_input(v.name)
            sizes = [(env[id(v)], axis) for axis in range(v.type.rank)]
        for d, size in zip(v.type.shape, sizes):
            if isinstance(d, sympy.Symbol) and d.name not in b.symbols:
                b.symbols[d.name] = size
    for name, v in graph.params.items():
        if name not in weights:
            raise LoweringError(f"no weight for parameter %{name}")
        env[id(v)] = b.add_constant(name, weights[name])
    for node in graph.nodes:
        args = [None if v is None else env[id(v)] for v in node.inputs]
        attrs = {k: b.attr(a) for k, a in node.attrs.items()}
        if node.op not in FX_LOWERINGS:
            raise UnsupportedOpError(f"IR op {node.op!r} is not registered and has no lowering")
        result = FX_LOWERINGS[node.op](b, node, args, attrs)
        for i, v in enumerate(node.outputs):
            env[id(v)] = result if len(node.outputs) == 1 else b.call(operator.getitem, result, i)
    state_values = {id(n.outputs[0]) for n in graph.nodes if n.op == "kv_write" and n.inputs[0].name in state}
    returned = [v for v in graph.outputs if id(v) not in state_values]
    b.graph.output(tuple(env[id(v)] for v in returned))
    for node in [n for n in b.graph.nodes if n.op == "get_attr" and not n.users]:
        b.graph.erase_node(node)  # e.g. a weight a custom linear replaced by its packed copy
    module = fx.GraphModule(b.root, b.graph, class_name="KilnFxModule")
    module.input_names, module.output_names = input_names, [v.name for v in returned]
    return module
