"""Routing ops of mixture-of-experts models: `topk` picks each token's experts, `gathered_matmul`
applies each routed row's expert weights."""

import torch

from ..registry import REQUIRED, OpDef, OpError, register
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
