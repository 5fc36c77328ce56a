"""Fused ops the fusion passes (`kiln.passes`, phase `fuse`) produce.

This file is a contract shared by every backend (inductor, onnxruntime, tinygrad): change an
op's meaning only with all of them.
- `add_rms_norm(x, residual, weight?) {eps, offset}` -> (normed, sum): sum = x + residual,
  normed = rms_norm(sum, weight) {eps, offset}. Two outputs, so the residual stream keeps
  flowing past the norm (ONNX Runtime's SkipSimplifiedLayerNormalization).
- `rope(x, positions, cos_table, sin_table)`: rotary position embedding, rotate-half
  (non-interleaved) form. x is [batch, heads, seq, head_dim], positions i64 [batch, seq],
  the tables [max_positions, rotary_dim / 2] (constants: the model's cos/sin at positions
  0..max_positions-1). With x1, x2 the halves of x[..., :rotary_dim] and c, s = table[positions]
  broadcast over heads: out = cat(x1*c - x2*s, x2*c + x1*s, x[..., rotary_dim:]).
  This is ONNX Runtime's com.microsoft RotaryEmbedding (interleaved=0, rotary_embedding_dim).

Other fusions need no new op (see the passes): merged q/k/v or gate/up projections are one
`linear` followed by `slice`s of its last axis; a bias is `linear`'s own input; an activation
spelled out in elementwise math becomes `silu` / `gelu`; a matmul by a transposed weight becomes
`linear`; the eager matmul/softmax/matmul attention becomes `attention`.
"""

import torch

from ..dims import dims_equal
from ..registry import REQUIRED, OpDef, OpError, register
from .nn import _rms_norm_ref


def _add_rms_norm_infer(x, residual, weight, eps, offset):
    if (
        x.dtype != residual.dtype
        or x.rank != residual.rank
        or not all(dims_equal(a, b) for a, b in zip(x.shape, residual.shape))
    ):
        raise OpError(f"add_rms_norm: x {x} and residual {residual} must have one type")
    if weight is not None and (weight.rank != 1 or not dims_equal(weight.shape[0], x.shape[-1])):
        raise OpError(f"add_rms_norm: weight {weight} does not match the last dim of {x}")
    return x, x


def _add_rms_norm_ref(x, residual, weight, eps, offset):
    total = x + residual
    return _rms_norm_ref(total, weight, eps, offset), total


def _rope_infer(x, positions, cos_table, sin_table):
    if x.rank != 4:
        raise OpError(f"rope: x must be [batch, heads, seq, head_dim], got {x}")
    if positions.dtype not in ("i64", "i32") or positions.rank != 2:
        raise OpError(f"rope: positions must be integers [batch, seq], got {positions}")
    if not (dims_equal(positions.shape[0], x.shape[0]) and dims_equal(positions.shape[1], x.shape[2])):
        raise OpError(f"rope: positions {positions} do not match x {x} ([batch, heads, seq, head_dim])")
    if cos_table != sin_table or cos_table.rank != 2:
        raise OpError(
            f"rope: cos/sin tables must both be [max_positions, rotary_dim / 2], got {cos_table}, {sin_table}"
        )
    half, head_dim = cos_table.shape[1], x.shape[3]
    if isinstance(half, int) and isinstance(head_dim, int) and 2 * half > head_dim:
        raise OpError(f"rope: rotary dim {2 * half} exceeds head dim {head_dim}")
    return x


def rope_reference(x, positions, cos_table, sin_table):
    """The contract's formula, in plain torch (x * cos + rotate_half(x) * sin, rewritten)."""
    half = cos_table.shape[-1]
    c, s = cos_table[positions][:, None], sin_table[positions][:, None]  # [batch, 1, seq, half]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1).to(x.dtype)


register(
    OpDef(
        "add_rms_norm",
        ("x", "residual", "weight?"),
        _add_rms_norm_infer,
        _add_rms_norm_ref,
        attrs={"eps": REQUIRED, "offset": 0.0},
        doc="(rms_norm(x + residual, weight) {eps, offset}, x + residual)",
    )
)
register(
    OpDef(
        "rope",
        ("x", "positions", "cos_table", "sin_table"),
        _rope_infer,
        rope_reference,
        doc="rotate-half rotary embedding of x[..., :2 * cos_table.shape[1]] at positions; the rest passes",
    )
)
