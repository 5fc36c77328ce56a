"""`linear_q` and `embedding_q` (ir/ops/quantized.py) as tinygrad Tensor operations.

The weight is dequantized inside the kernel that uses it: tinygrad fuses the unpacking, the
zero point and the scale into the matrix product's loads, so a decode step reads the int8 or
packed int4 bytes, not an f32 copy of the weight.
"""
from __future__ import annotations

from tinygrad import Tensor, dtypes

SYMMETRIC_ZERO = {8: 0, 4: 8}


def expand_groups(per_group: Tensor, group_size: int, in_features: int) -> Tensor:
    """[N, groups] -> [N, K]: each group's value repeated over its columns."""
    n, groups = per_group.shape
    full = per_group.reshape(n, groups, 1).expand(n, groups, group_size).reshape(n, groups * group_size)
    return full[:, :in_features]


def dequantize(qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int) -> Tensor:
    """The f32 [N, K] weight (q - z) * scale, per group of K (lazy: fused into its reader)."""
    if bits == 4:
        low, high = qweight.bitwise_and(0x0F), qweight.rshift(4)
        q = low.unsqueeze(-1).cat(high.unsqueeze(-1), dim=-1).reshape(qweight.shape[0], qweight.shape[1] * 2)
    else:
        q = qweight
    k = q.shape[1]
    q = q.cast(dtypes.float32)
    zero = SYMMETRIC_ZERO[bits] if zeros is None else expand_groups(zeros.cast(dtypes.float32), group_size, k)
    return (q - zero) * expand_groups(scales, group_size, k)


def lower_linear_q(ctx, node, args, attrs):
    x, qweight, scales, zeros, bias = args
    y = x @ dequantize(qweight, scales, zeros, attrs["bits"], attrs["group_size"]).T
    return y + bias if bias is not None else y


def lower_embedding_q(ctx, node, args, attrs):
    qweight, scales, ids, zeros = args
    flat = ids.reshape(-1).cast(dtypes.int32)
    rows = dequantize(qweight[flat], scales[flat], None if zeros is None else zeros[flat],
                      attrs["bits"], attrs["group_size"])
    return rows.reshape(*ids.shape, rows.shape[-1])
