"""An ONNX graph under construction, fed from a Kiln IR graph.

`OnnxBuilder` maps IR values to ONNX value names, adds nodes under layer-namespaced names
(`/model/layers.3/self_attn.q_proj/MatMul`), turns weights and constants into initializers, and
turns symbolic dims into ONNX: `batch`/`seq` become dim_params in value types, and where an op
needs a dim's value at run time (a Reshape to `[batch*seq, 64]`), a few Shape/Slice/Mul nodes
compute it from the graph input the symbol is bound to.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterable

import numpy as np
import onnx
import sympy
import torch
from onnx import TensorProto, helper

from kiln.ir import Graph, Node, Value
from kiln.ir.dims import format_dim

from .errors import OnnxLoweringError

MS_DOMAIN = "com.microsoft"
INT64_MAX = 2**63 - 1

ELEM_TYPES = {
    "f64": TensorProto.DOUBLE,
    "f32": TensorProto.FLOAT,
    "f16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
    "i64": TensorProto.INT64,
    "i32": TensorProto.INT32,
    "i16": TensorProto.INT16,
    "i8": TensorProto.INT8,
    "u8": TensorProto.UINT8,
    "bool": TensorProto.BOOL,
}
NUMPY_DTYPES = {
    "f64": np.float64,
    "f32": np.float32,
    "f16": np.float16,
    "i64": np.int64,
    "i32": np.int32,
    "i16": np.int16,
    "i8": np.int8,
    "u8": np.uint8,
    "bool": np.bool_,
}


def elem_type(dtype: str) -> int:
    """The ONNX element type of an IR dtype name."""
    return ELEM_TYPES[dtype]


def onnx_dims(shape) -> list:
    """IR dims as ONNX dims: ints stay, a symbol or expression becomes a dim_param string."""
    return [d if isinstance(d, int) else format_dim(d) for d in shape]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A weight as a numpy array (bf16 has no numpy dtype: it is widened to f32 bits-exactly)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        raise OnnxLoweringError("bf16 weights are not supported by the onnxruntime backend yet; compile with dtype f32")
    return tensor.numpy()


class OnnxBuilder:
    """Nodes, initializers and value names of the ONNX graph being written."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor]):
        self.graph = graph
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, np.ndarray] = {}
        self.value_infos: list[onnx.ValueInfoProto] = []
        self.opsets: set[str] = {""}
        self._names: dict[int, str] = {}  # id(IR value) -> ONNX name
        self._node_names: set[str] = set()
        self._counters: dict[str, itertools.count] = {}
        self._constants: dict[tuple, str] = {}
        self._dims: dict[sympy.Expr, str] = {}
        self.symbol_sources: dict[str, tuple[str, int]] = {}  # symbol -> (ONNX input, axis)
        self.scope = "/model"
        self.label: str | None = None  # the default node label (the weight stem of the IR node lowered)
        self.memo: dict[str, object] = {}  # values shared by many nodes (GQA's sequence lengths)
        self.renames: dict[str, str] = {}  # ONNX name -> the name that replaces it everywhere

    # -- IR values ------------------------------------------------------------------------
    def define(self, value: Value, name: str) -> None:
        """Say that IR `value` is computed as ONNX value `name`."""
        self._names[id(value)] = name

    def defined(self, value: Value) -> bool:
        return id(value) in self._names

    def rename(self, old: str, new: str) -> None:
        """Make every use of ONNX value `old` read `new` instead (applied when the model is built)."""
        self.renames[old] = new

    def value(self, value: Value | None) -> str:
        """The ONNX name of an IR value ("" for an omitted optional input); weights on first use."""
        if value is None:
            return ""
        if id(value) not in self._names:
            if value.name not in self.graph.params:
                raise OnnxLoweringError(f"%{value.name} is used before it is defined")
            self.initializer(value.name, to_numpy(self.weights[value.name]))
            self._names[id(value)] = value.name
        return self._names[id(value)]

    def weight(self, value: Value) -> np.ndarray | None:
        """The constant behind an IR value: a parameter's tensor or a `full` of static shape."""
        if value.name in self.graph.params and value.name in self.weights:
            return to_numpy(self.weights[value.name])
        node = value.producer
        if node is not None and node.op == "full" and all(isinstance(d, int) for d in node.attrs["shape"]):
            return np.full(node.attrs["shape"], node.attrs["value"], dtype=NUMPY_DTYPES[node.attrs["dtype"]])
        return None

    def scalar(self, value: Value) -> float | None:
        """The number a one-element constant IR value holds, else None."""
        array = self.weight(value)
        return float(array.reshape(-1)[0]) if array is not None and array.size == 1 else None

    # -- nodes and constants --------------------------------------------------------------
    def node(
        self,
        op_type: str,
        inputs: Iterable[str],
        outputs: int | list = 1,
        domain: str = "",
        label: str | None = None,
        **attrs,
    ) -> list[str]:
        """Append a node named after the current scope (and label); returns its output names.

        `outputs` is a count, or a list of names where None means "name it after the node"."""
        label = label or self.label
        name = self._node_name(f"{label}/{op_type}" if label else op_type)
        if isinstance(outputs, int):
            outputs = [None] * outputs
        outputs = [f"{name}/output_{i}" if o is None else o for i, o in enumerate(outputs)]
        self.opsets.add(domain)
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, domain=domain, **attrs))
        return outputs

    def op(self, op_type: str, *inputs: str, domain: str = "", label: str | None = None, **attrs) -> str:
        """A one-output node; returns its output name."""
        return self.node(op_type, inputs, 1, domain=domain, label=label, **attrs)[0]

    def _node_name(self, label: str) -> str:
        base = f"{self.scope}/{label}"
        counter = self._counters.setdefault(base, itertools.count())
        name = base
        while name in self._node_names:
            name = f"{base}_{next(counter) + 1}"
        self._node_names.add(name)
        return name

    def initializer(self, name: str, array: np.ndarray) -> str:
        if name in self.initializers:
            raise OnnxLoweringError(f"initializer {name} is defined twice")
        self.initializers[name] = (
            np.array(array, order="C", copy=False) if array.flags.c_contiguous else array.copy(order="C")
        )
        return name

    def const(self, array, dtype=np.int64) -> str:
        """A small constant initializer, shared between all users of the same value."""
        array = np.asarray(array, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            shape = "x".join(map(str, array.shape)) or "scalar"
            self._constants[key] = self.initializer(f"/const/{array.dtype.name}[{shape}]/{len(self._constants)}", array)
        return self._constants[key]

    def cast(self, name: str, from_dtype: str, to_dtype: str) -> str:
        return name if from_dtype == to_dtype else self.op("Cast", name, to=elem_type(to_dtype))

    def typed(self, value: Value, dtype: str) -> str:
        """An IR value's ONNX name, cast to `dtype` if it is of another type."""
        return self.cast(self.value(value), value.type.dtype, dtype)

    def declare(self, name: str, dtype: str, shape) -> None:
        """Record a value's type (for outputs of contrib ops, whose types ONNX cannot infer)."""
        self.value_infos.append(helper.make_tensor_value_info(name, elem_type(dtype), onnx_dims(shape)))

    # -- symbolic dims --------------------------------------------------------------------
    def bind_symbols(self, input_name: str, shape) -> None:
        """Remember where each bare-symbol dim of a graph input can be read at run time."""
        for axis, d in enumerate(shape):
            if isinstance(d, sympy.Symbol) and d.name not in self.symbol_sources:
                self.symbol_sources[d.name] = (input_name, axis)

    def dim(self, d) -> str:
        """A dim's value at run time as an i64[1] tensor (a constant when the dim is an int)."""
        if isinstance(d, int) or (isinstance(d, sympy.Expr) and d.is_Integer):
            return self.const([int(d)])
        if d not in self._dims:
            self._dims[d] = self._emit_dim(d)
        return self._dims[d]

    def _emit_dim(self, d: sympy.Expr) -> str:
        saved, self.scope = self.scope, "/model/dims"
        try:
            if isinstance(d, sympy.Symbol):
                if d.name not in self.symbol_sources:
                    raise OnnxLoweringError(
                        f"symbol {d.name} is not a dim of any graph input, so its run-time "
                        "value is unknown; give some input a dim of exactly " + d.name
                    )
                source, axis = self.symbol_sources[d.name]
                return self.op("Shape", source, start=axis, end=axis + 1)
            if isinstance(d, (sympy.Add, sympy.Mul)):
                onnx_op = "Add" if isinstance(d, sympy.Add) else "Mul"
                terms = [self.dim(t) for t in d.args]
                result = terms[0]
                for term in terms[1:]:
                    result = self.op(onnx_op, result, term)
                return result
            if isinstance(d, sympy.Pow) and d.exp.is_Integer and d.exp > 0:
                base = self.dim(d.base)
                result = base
                for _ in range(int(d.exp) - 1):
                    result = self.op("Mul", result, base)
                return result
            if isinstance(d, sympy.floor):
                numerator, denominator = sympy.fraction(sympy.together(d.args[0]))
                if denominator.is_Integer:
                    return self.op("Div", self.dim(sympy.expand(numerator)), self.const([int(denominator)]))
            raise OnnxLoweringError(f"dim expression {format_dim(d)} has no ONNX lowering (supported: + * ** floor)")
        finally:
            self.scope = saved

    def shape(self, dims) -> str:
        """A shape as an i64[rank] tensor: one constant, or runs of constants and run-time dims."""
        dims = list(dims)
        if all(isinstance(d, int) for d in dims):
            return self.const(dims)
        pieces, run = [], []
        for d in dims:
            if isinstance(d, int):
                run.append(d)
                continue
            if run:
                pieces.append(self.const(run))
                run = []
            pieces.append(self.dim(d))
        if run:
            pieces.append(self.const(run))
        return self.op("Concat", *pieces, axis=0)

    def scalar_dim(self, d) -> str:
        """A dim's value at run time as an i64 scalar (for Range)."""
        if isinstance(d, int):
            return self.const(d)
        return self.op("Squeeze", self.dim(d), self.const([0]))


@contextlib.contextmanager
def shared_scope(b: OnnxBuilder, scope: str):
    """Name the nodes built inside under `scope` (e.g. /model/tree): values every layer reads,
    built once."""
    saved, b.scope, b.label = (b.scope, b.label), scope, None
    try:
        yield
    finally:
        b.scope, b.label = saved


def layer_scopes(graph: Graph) -> dict[int, str]:
    """A namespace per IR node, like `/model/layers.3`: that of the weights it reads, else that
    of its latest-defined input (so attention math inherits its layer from the projections)."""
    scopes: dict[int, str] = {}
    value_scope: dict[int, tuple[int, str]] = {}  # id(value) -> (definition order, scope)
    for order, node in enumerate(graph.nodes):
        scope = None
        for v in node.inputs:
            if v is not None and v.name in graph.params:
                scope = param_scope(v.name)
                break
        if scope is None:
            known = [value_scope[id(v)] for v in node.inputs if v is not None and id(v) in value_scope]
            scope = max(known)[1] if known else "/model"
        scopes[id(node)] = scope
        for v in node.outputs:
            value_scope[id(v)] = (order, scope)
    return scopes


def param_scope(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `/model/layers.3`; `lm_head.weight` -> `/lm_head`."""
    match = re.match(r"^(.*?)\.(\d+)\.", name)
    if match:
        return "/" + match.group(1).replace(".", "/") + "." + match.group(2)
    return "/" + name.rsplit(".", 1)[0].replace(".", "/")


def param_label(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `mlp.up_proj` (the node label inside its scope)."""
    match = re.match(r"^.*?\.\d+\.(.*)$", name)
    stem = match.group(1) if match else name
    return stem.rsplit(".", 1)[0] if "." in stem else stem


def node_label(graph: Graph, node: Node) -> str | None:
    """The label of a node that reads a weight (its weight's stem), else None."""
    for v in node.inputs:
        if v is not None and v.name in graph.params:
            return param_label(v.name)
    return None
