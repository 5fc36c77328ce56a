"""Quantized-weight ops: weights held as low-bit integers with per-group scales and zero points.

- `linear_q(x, qweight, scales, zeros?, bias?) {bits, group_size}` = F.linear(x, dequantize(...), bias);
  x (and bias) f32, f16 or bf16, the output in x's dtype: the weight is dequantized in f32, then
  cast to x's dtype for the product (what a half-precision model's nn.Linear multiplies by)
- `embedding_q(qweight, scales, ids, zeros?) {bits, group_size, dtype="f32"}` = rows `ids` of the
  dequantized table, dequantized in f32 and cast to `dtype` (the dtype of the table it replaced:
  f32, f16 or bf16)

A weight W [N, K] (nn.Linear's [out, in]) is cut along K into groups of `group_size` columns (the
last one may be shorter when group_size does not divide K; per-channel is group_size = K), and

    W[n, k] = (q[n, k] - z[n, k // group_size]) * scales[n, k // group_size]

- bits 8: qweight i8 [N, K], symmetric only: zeros omitted, z = 0.
- bits 4: qweight u8 [N, K / 2], two values 0..15 per byte, element 2j in the LOW nibble and 2j+1
  in the high one (ONNX Runtime's MatMulNBits B layout, row by row). zeros omitted: symmetric,
  z = 8; else zeros [N, groups]: u8 holding 0..15, one per byte (an integer zero point), or the
  scales' float dtype (a fractional one: the grid's offset is free, as in llama.cpp's Q4_1/Q4_K
  `d * q + m`, with z = -m / d).
- scales f32 or f16 [N, groups], groups = ceil(K / group_size) (f16: half the bytes), whatever the
  graph's dtype: the weight is dequantized in f32, then cast to the dtype it is used in.

This file is a contract shared by the quantize pass and every backend: change it with all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dims import dims_equal, format_dim
from ..dtypes import TORCH_DTYPES
from ..registry import REQUIRED, OpDef, OpError, register

QWEIGHT_DTYPES = {8: "i8", 4: "u8"}
SCALE_DTYPES = ("f32", "f16")
ACTIVATION_DTYPES = ("f32", "f16", "bf16")  # x and the output of linear_q, the rows of embedding_q
SYMMETRIC_ZERO = {8: 0, 4: 8}  # z when `zeros` is omitted


def group_count(in_features: int, group_size: int) -> int:
    """Groups per row: ceil(K / group_size)."""
    return -(-in_features // group_size)


def in_features(qweight_cols, bits: int):
    """K from the qweight's column count (two 4-bit values per byte)."""
    return qweight_cols * 2 if bits == 4 else qweight_cols


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """u8 [N, K] of values 0..15 (K even) -> u8 [N, K / 2]: element 2j low nibble, 2j+1 high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: u8 [N, K / 2] -> u8 [N, K]."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def expand_groups(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[N, groups] -> [N, K]: each group's value repeated over its columns."""
    return per_group.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int
) -> torch.Tensor:
    """The f32 [N, K] weight that (qweight, scales, zeros) stand for (the formula above); stacked
    weights [..., N, K] (a mixture's experts) dequantize each matrix alike."""
    if qweight.dim() > 2:
        flat = [None if t is None else t.flatten(0, -2) for t in (qweight, scales, zeros)]
        return dequantize(*flat, bits, group_size).view(*qweight.shape[:-1], -1)
    q = unpack_int4(qweight) if bits == 4 else qweight
    k = q.shape[1]
    z = SYMMETRIC_ZERO[bits] if zeros is None else expand_groups(zeros.float(), group_size, k)
    return (q.float() - z) * expand_groups(scales.float(), group_size, k)


def check_quantized_weight(op: str, qweight, scales, zeros, bits, group_size):
    """Check the weight's parts against each other; returns (N, K)."""
    if bits not in QWEIGHT_DTYPES:
        raise OpError(f"{op}: bits must be 4 or 8, got {bits}")
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise OpError(f"{op}: group_size must be an even int >= 2, got {group_size!r}")
    if qweight.rank != 2 or qweight.dtype != QWEIGHT_DTYPES[bits]:
        raise OpError(
            f"{op}: a {bits}-bit qweight is {QWEIGHT_DTYPES[bits]}[N, {'K / 2' if bits == 4 else 'K'}], got {qweight}"
        )
    n, cols = qweight.shape
    if not isinstance(cols, int):
        raise OpError(f"{op}: qweight {qweight} needs a static in-features dim")
    k = in_features(cols, bits)
    groups = group_count(k, group_size)
    if (
        scales.dtype not in SCALE_DTYPES
        or scales.rank != 2
        or not dims_equal(scales.shape[0], n)
        or scales.shape[1] != groups
    ):
        raise OpError(
            f"{op}: scales must be f32 or f16 [{format_dim(n)}, {groups}] (K={k}, group_size={group_size}), "
            f"got {scales}"
        )
    if zeros is not None:
        if bits == 8:
            raise OpError(f"{op}: 8-bit weights are symmetric; omit zeros")
        if zeros.dtype not in ("u8", scales.dtype) or zeros.shape != scales.shape:
            raise OpError(
                f"{op}: zeros must be u8 (integer zero points) or {scales.dtype} (fractional ones, the scales' "
                f"dtype) shaped like scales {scales}, got {zeros}"
            )
    return n, k


def _linear_q_infer(x, qweight, scales, zeros, bias, bits, group_size):
    n, k = check_quantized_weight("linear_q", qweight, scales, zeros, bits, group_size)
    if x.dtype not in ACTIVATION_DTYPES or not dims_equal(x.shape[-1], k):
        raise OpError(f"linear_q: input {x} must be f32, f16 or bf16 with last dim K={k}")
    if bias is not None and (bias.rank != 1 or not dims_equal(bias.shape[0], n) or bias.dtype != x.dtype):
        raise OpError(f"linear_q: bias {bias} must be {x.dtype}[{format_dim(n)}] (the input's dtype)")
    return x.with_shape(x.shape[:-1] + (n,))


def linear_q_reference(x, qweight, scales, zeros, bias, bits, group_size):
    """Dequantize in f32, cast to x's dtype, then F.linear."""
    return F.linear(x, dequantize(qweight, scales, zeros, bits, group_size).to(x.dtype), bias)


def _embedding_q_infer(qweight, scales, ids, zeros, bits, group_size, dtype="f32"):
    _, k = check_quantized_weight("embedding_q", qweight, scales, zeros, bits, group_size)
    if ids.dtype not in ("i64", "i32"):
        raise OpError(f"embedding_q: ids must be integers, got {ids.dtype}")
    if dtype not in ACTIVATION_DTYPES:
        raise OpError(f"embedding_q: dtype must be one of {ACTIVATION_DTYPES} (the table's), got {dtype!r}")
    return scales.with_shape(ids.shape + (k,)).with_dtype(dtype)


def embedding_q_reference(qweight, scales, ids, zeros, bits, group_size, dtype="f32"):
    """Gather the rows, then dequantize only those (in f32), then cast to `dtype`."""
    flat = ids.reshape(-1)
    rows = dequantize(qweight[flat], scales[flat], None if zeros is None else zeros[flat], bits, group_size)
    return rows.reshape(*ids.shape, rows.shape[-1]).to(TORCH_DTYPES[dtype])


register(
    OpDef(
        "linear_q",
        ("x", "qweight", "scales", "zeros?", "bias?"),
        _linear_q_infer,
        linear_q_reference,
        attrs={"bits": REQUIRED, "group_size": REQUIRED},
        doc="F.linear(x, (q - z) * scales per group of K, bias); see ir/ops/quantized.py",
    )
)
register(
    OpDef(
        "embedding_q",
        ("qweight", "scales", "ids", "zeros?"),
        _embedding_q_infer,
        embedding_q_reference,
        attrs={"bits": REQUIRED, "group_size": REQUIRED, "dtype": "f32"},
        doc="rows `ids` of the dequantized [vocab, K] table, in `dtype`; see ir/ops/quantized.py",
    )
)
