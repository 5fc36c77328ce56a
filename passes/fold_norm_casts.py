"""fold_norm_casts: a half-precision model's norm, written around f32 casts -> one `rms_norm`.

Models run in f16/bf16 compute their norms in f32 (the capture records it as casts):
    Llama, Qwen2, Mistral: out = weight * cast(rms_norm(cast(x, f32)), half)
    Gemma:                 out = cast(rms_norm(cast(x, f32), cast(weight, f32)), half)
Both become `out = rms_norm(x, weight)` on the half-precision x, which the IR defines to compute
in f32 (so fuse_add_rms_norm can then take the residual add, and backends run one fused kernel
that reads and writes half precision). The Gemma form is the same computation; the Llama form
multiplies by the weight before rounding to half instead of after (at most one rounding of
difference). Runs after fuse_rms_norm; matches nothing in an f32 graph.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, Value

from .dce import eliminate_dead_code
from .match import made_by, sole_reader

HALF = ("f16", "bf16")


def _upcast_from_half(value: Value | None) -> Value | None:
    """x, when `value` is cast(x, f32) of a half-precision x."""
    cast = made_by(value, "cast")
    if cast is None or cast.attrs["dtype"] != "f32" or cast.inputs[0].type.dtype not in HALF:
        return None
    return cast.inputs[0]


def _downcast(norm: Node, dtype: str) -> Node | None:
    """The sole reader of the norm when it casts the result back to `dtype`."""
    cast = sole_reader(norm.output)
    return cast if cast is not None and cast.op == "cast" and cast.attrs["dtype"] == dtype else None


def _weight_multiply(cast: Node) -> tuple[Node, Value] | None:
    """(mul node, weight) when the cast's sole reader multiplies it by a [hidden] weight."""
    mul = sole_reader(cast.output)
    if mul is None or mul.op != "mul":
        return None
    other = mul.inputs[1] if mul.inputs[0] is cast.output else mul.inputs[0]
    x_type = cast.output.type
    if other.type.dtype != x_type.dtype or other.type.rank != 1 or mul.output.type != x_type:
        return None
    return mul, other


def fold_norm_casts(graph: Graph) -> Graph:
    """Rewrite each f32-cast rms_norm of a half-precision input, in place; dead nodes go."""
    for norm in [n for n in graph.nodes if n.op == "rms_norm"]:
        x = _upcast_from_half(norm.inputs[0])
        if x is None:
            continue
        cast = _downcast(norm, x.type.dtype)
        weight = norm.inputs[1]
        if weight is not None:  # Gemma's form: the weight comes in as cast(w, f32) of a half w
            weight = _upcast_from_half(weight)
            if weight is None or weight.type.dtype != x.type.dtype:
                continue
        if cast is None:
            continue
        last = cast
        if weight is None:  # Llama's form: the weight multiplies after the cast back
            found = _weight_multiply(cast)
            if found is not None and norm.attrs.get("offset", 0.0) == 0.0:
                last, weight = found
        fused = graph.create("rms_norm", [x, weight], dict(norm.attrs))
        graph.insert_before(last, fused)
        graph.replace_all_uses(last.output, fused.output)
    return eliminate_dead_code(graph)
