"""Routing ops of mixture-of-experts models: `topk` picks each token's experts, `gathered_matmul`
applies each routed row's expert weights, `gathered_matmul_q` the same with the experts
quantized (each expert's [out, in] matrix in linear_q's layout, ir/ops/quantized.py, stacked)."""

import torch

from ..dims import dims_equal
from ..registry import REQUIRED, OpDef, OpError, register
from .quantized import check_quantized_weight, dequantize
from .shape_rules import norm_axis


def _topk_infer(x, k, axis, largest):
    axis = norm_axis(axis, x.rank)
    size = x.shape[axis]
    if isinstance(size, int) and not 0 < k <= size:
        raise OpError(f"topk: k={k} is not in 1..{size} (the size of axis {axis})")
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1 :]
    return x.with_shape(shape), x.with_shape(shape).with_dtype("i64")


def _topk_reference(x, k, axis, largest):
    values, indices = torch.topk(x, k, dim=axis, largest=largest, sorted=True)
    return values, indices


register(
    OpDef(
        "topk",
        ("x",),
        _topk_infer,
        _topk_reference,
        attrs={"k": REQUIRED, "axis": -1, "largest": True},
        doc="(values, i64 indices) of the k largest (or smallest) entries along axis, sorted, ties to the lower index",
    )
)


def _gathered_matmul_infer(weights, ids, x):
    if weights.rank != 3 or ids.rank != 1 or x.rank != 3:
        raise OpError("gathered_matmul: weights [experts, out, in], ids [rows], x [rows, in, cols] expected")
    if ids.dtype not in ("i64", "i32"):
        raise OpError("gathered_matmul: ids must be integers")
    return x.with_shape((x.shape[0], weights.shape[1], x.shape[2])).with_dtype(weights.dtype)


def _gathered_matmul_reference(weights, ids, x):
    return weights[ids] @ x.to(weights.dtype)


register(
    OpDef(
        "gathered_matmul",
        ("weights", "ids", "x"),
        _gathered_matmul_infer,
        _gathered_matmul_reference,
        doc="out[n] = weights[ids[n]] @ x[n]: each row's expert matrix applied in place, never gathered into a copy",
    )
)


def _gathered_matmul_q_infer(qweight, scales, ids, x, zeros, bits, group_size):
    parts = [p for p in (qweight, scales, zeros) if p is not None]
    if any(p.rank != 3 for p in parts) or not all(dims_equal(p.shape[0], qweight.shape[0]) for p in parts):
        raise OpError(
            "gathered_matmul_q: qweight, scales and zeros are stacked per expert [experts, out, ...], "
            f"got {', '.join(str(p) for p in parts)}"
        )
    per_expert = [None if p is None else p.with_shape(p.shape[1:]) for p in (qweight, scales, zeros)]
    out, k = check_quantized_weight("gathered_matmul_q", *per_expert, bits, group_size)
    if ids.rank != 1 or ids.dtype not in ("i64", "i32"):
        raise OpError(f"gathered_matmul_q: ids must be integers [rows], got {ids}")
    if x.rank != 3 or x.dtype != "f32" or not dims_equal(x.shape[1], k) or not dims_equal(x.shape[0], ids.shape[0]):
        raise OpError(f"gathered_matmul_q: x must be f32 [rows, {k}, cols] with a row per id, got {x} for ids {ids}")
    return x.with_shape((x.shape[0], out, x.shape[2]))


def gathered_matmul_q_reference(qweight, scales, ids, x, zeros, bits, group_size):
    """Gather the routed experts' codes, dequantize only those, multiply."""
    rows, out = ids.shape[0], qweight.shape[1]
    weights = dequantize(
        qweight[ids].flatten(0, 1),
        scales[ids].flatten(0, 1),
        None if zeros is None else zeros[ids].flatten(0, 1),
        bits,
        group_size,
    )
    return weights.view(rows, out, -1) @ x


register(
    OpDef(
        "gathered_matmul_q",
        ("qweight", "scales", "ids", "x", "zeros?"),
        _gathered_matmul_q_infer,
        gathered_matmul_q_reference,
        attrs={"bits": REQUIRED, "group_size": REQUIRED},
        doc="gathered_matmul over quantized experts: out[n] = dequantize(expert ids[n]) @ x[n]; "
        "qweight, scales, zeros [experts, out, ...] in linear_q's layout per expert",
    )
)
