"""`linear_q`, `embedding_q` (ir/ops/quantized.py) and `gathered_matmul_q` (quantized MoE experts,
ir/ops/routing.py) as tinygrad Tensor operations.

tinygrad has no low-bit kernel, so the codes are turned into f32 inside the kernels that read
them, in two forms:
- **decode** (a few rows of x): the product is written group by group, `scale * (sum x * q -
  zero * sum x)` per group of K, on the codes themselves, so a step reads the int8 or packed
  int4 bytes and the scale multiplies once per group instead of once per weight. The partial
  sums [rows, N, groups] are one kernel (a split-K product, which tinygrad's heuristic tiles well
  on this CPU), their scaled sum a second, tiny one.
- **prefill** (many rows, or a symbolic count): the weight is dequantized to [N, K] f32 and
  multiplied, fused into the matmul's loads. Over packed codes every static row count takes
  the grouped form, 4 rows per unpacked code (kernel_opts.py): a 512-token product over
  SmolLM2's 1536 x 576 int4-g32 codes took 6.5 ms against 34 ms dequantized into the matmul.
In both, x is made contiguous first: left lazy, tinygrad fuses the ops producing it (the RMS
norm, silu(gate) * up) into the product's loads and recomputes them for every output; that
made SmolLM2's int4 layers 5-6x slower (weight_layouts.matvec does the same for f32).
A linear_q weight the backend stores packed (packed_codes.py: 32-bit words, 16 rows interleaved)
takes the same two forms on that layout.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes

from . import packed_codes
from .weight_layouts import split_count

SYMMETRIC_ZERO = {8: 0, 4: 8}
DECODE_ROWS = 8  # at most this many rows of x take the grouped (decode) form


def expand_groups(per_group: Tensor, group_size: int, in_features: int) -> Tensor:
    """[N, groups] -> [N, K]: each group's value repeated over its columns."""
    n, groups = per_group.shape
    full = per_group.reshape(n, groups, 1).expand(n, groups, group_size).reshape(n, groups * group_size)
    return full[:, :in_features]


def unpack_int4(qweight: Tensor) -> tuple[Tensor, Tensor]:
    """The even and odd columns' codes [N, K/2] of a packed int4 weight (low nibble = even)."""
    return qweight.bitwise_and(0x0F), qweight.rshift(4)


def dequantize(qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int) -> Tensor:
    """The f32 [N, K] weight (q - z) * scale, per group of K (lazy: fused into its reader)."""
    if bits == 4:
        low, high = unpack_int4(qweight)
        q = low.unsqueeze(-1).cat(high.unsqueeze(-1), dim=-1).reshape(qweight.shape[0], qweight.shape[1] * 2)
    else:
        q = qweight
    k = q.shape[1]
    q = q.cast(dtypes.float32)
    zero = SYMMETRIC_ZERO[bits] if zeros is None else expand_groups(zeros.cast(dtypes.float32), group_size, k)
    return (q - zero) * expand_groups(scales.cast(dtypes.float32), group_size, k)  # f16 scales too


def grouped_product(
    x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int
) -> Tensor:
    """x @ W.T for the quantized W, summed per group on the codes, then scaled (K % group_size = 0).

    Few, long groups (per-channel int8: one group of K) are cut into `splits` blocks each, so the
    partial-sum kernel has enough outputs for tinygrad to tile (weight_layouts.split_count)."""
    n, groups = scales.shape
    splits = split_count(n * groups, group_size // (2 if bits == 4 else 1))
    block = group_size // splits
    x = x.reshape(*x.shape[:-1], 1, groups, splits, block)
    if bits == 4:  # x's even and odd columns meet the low and high nibbles of the same byte
        x_even, x_odd = x[..., 0::2], x[..., 1::2]
        low, high = (c.cast(dtypes.float32).reshape(n, groups, splits, block // 2) for c in unpack_int4(qweight))
        dots = (x_even * low + x_odd * high).sum(-1)
        x_sums = (x_even + x_odd).sum(-1)
    else:
        dots = (x * qweight.cast(dtypes.float32).reshape(n, groups, splits, block)).sum(-1)
        x_sums = x.sum(-1)
    zero = SYMMETRIC_ZERO[bits] if zeros is None else zeros.cast(dtypes.float32).unsqueeze(-1)
    scale = scales.cast(dtypes.float32).unsqueeze(-1)  # f16 scales too
    partial = (dots.contiguous() - zero * x_sums) * scale  # [.., N, groups, splits]
    return partial.sum((-2, -1))


def takes_grouped_form(x: Tensor, group_size: int, packed: bool = False) -> bool:
    """A few static rows (any static count over packed codes, whose product tiles along the
    rows: kernel_opts.py), and K in whole groups of an even size."""
    rows = 1
    for d in x.shape[:-1]:
        if not isinstance(d, int):
            return False  # a symbolic prefill length
        rows *= d
    return (packed or rows <= DECODE_ROWS) and x.shape[-1] % group_size == 0 and group_size % 2 == 0


def lower_linear_q(ctx, node, args, attrs):
    x, qweight, scales, zeros, bias = args
    bits, group_size = attrs["bits"], attrs["group_size"]
    x = ctx.last_rows(node, x).contiguous()
    if ctx.layouts.packed_bits(node.inputs[1]):
        if takes_grouped_form(x, group_size, packed=True):
            y = packed_codes.packed_product(x, qweight, scales, zeros, bits, group_size)
        else:
            y = x @ packed_codes.dequantized(qweight, scales, zeros, bits, group_size).T
    elif takes_grouped_form(x, group_size):
        y = grouped_product(x, qweight, scales, zeros, bits, group_size)
    else:
        y = x @ dequantize(qweight, scales, zeros, bits, group_size).T
    return y + bias if bias is not None else y


def lower_embedding_q(ctx, node, args, attrs):
    qweight, scales, ids, zeros = args
    flat = ids.reshape(-1).cast(dtypes.int32)
    if ctx.layouts.packed_bits(node.inputs[0]):
        rows = packed_codes.gathered_rows(qweight, scales, zeros, flat, attrs["bits"], attrs["group_size"])
        return rows.reshape(*ids.shape, rows.shape[-1])
    rows = dequantize(
        qweight[flat], scales[flat], None if zeros is None else zeros[flat], attrs["bits"], attrs["group_size"]
    )
    return rows.reshape(*ids.shape, rows.shape[-1])


def lower_gathered_matmul_q(ctx, node, args, attrs):
    """Quantized MoE experts: the routed experts' codes gathered, dequantized, multiplied."""
    qweight, scales, ids, x, zeros = args
    routed = ids.cast(dtypes.int32)
    rows, out = routed.shape[0], qweight.shape[1]
    parts = [None if t is None else t[routed].reshape(rows * out, t.shape[2]) for t in (qweight, scales, zeros)]
    weights = dequantize(*parts, attrs["bits"], attrs["group_size"])
    return weights.reshape(rows, out, weights.shape[1]) @ x
