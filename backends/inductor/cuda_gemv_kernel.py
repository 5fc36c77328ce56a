"""The Triton kernels of `kiln_cuda::gemv` and `kiln_cuda::gemv_int4` (cuda_gemv.py): y = x @ W.T
(+ bias) for a few rows of x and a weight W [N, K] in its stored layout (half, f32, int8 codes
with a scale per output, or Kiln's int4 codes with a scale and zero point per group), one
program per BLOCK_N outputs, every row at once.

A decode step's products are bound by reading W once: each program streams its BLOCK_N rows of
W along K in BLOCK_K chunks (coalesced: W's rows are contiguous along K), multiplies them with
every row of x (a few, held in registers chunk by chunk) and keeps the products in f32 tiles
summed once at the end, so the inner loop is loads and fused multiply-adds only. The block
sizes are chosen per shape on the GPU by Triton's autotuner (cuda_gemv.py), which is what keeps
a 2048-output product from running on a fraction of the GPU's SMs.

Imported only where Triton is (a CUDA machine, or tests running it under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, scales_ptr, bias_ptr, y_ptr, N, x_row, w_row, y_row,
    K: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """W as stored (a float dtype, or int8 codes with SCALED: one scale per output, applied to
    the sum)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < N
    m = tl.arange(0, ROWS_PAD)
    in_m = m < ROWS
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + kk
        in_k = k < K
        w = tl.load(w_ptr + n[:, None] * w_row + k[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * x_row + k[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [ROWS_PAD, BLOCK_N]
    if SCALED:
        y *= tl.load(scales_ptr + n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    _store(y, bias_ptr, y_ptr, n, in_n, m, in_m, y_row, HAS_BIAS)


@triton.jit
def gemv_int4_kernel(
    x_ptr, q_ptr, scales_ptr, zeros_ptr, bias_ptr, y_ptr, N, x_row, q_row, group_row, y_row,
    K: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """W[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // GROUP, from Kiln's packed codes (u8
    [N, K / 2], element 2j in the low nibble, 2j + 1 in the high one; z = 8 without zeros).
    Each byte's two codes share a group (GROUP is even): the even and odd columns of a block
    are two tiles of the same shape."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < N
    m = tl.arange(0, ROWS_PAD)
    in_m = m < ROWS
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([ROWS_PAD, BLOCK_N, BLOCK_K // 2], tl.float32)
    for start in range(0, K, BLOCK_K):
        even = start + 2 * j  # the column of each byte's low code
        in_k = even < K
        w_mask = in_n[:, None] & in_k[None, :]
        packed = tl.load(q_ptr + n[:, None] * q_row + (even // 2)[None, :], mask=w_mask, other=0)
        at_group = n[:, None] * group_row + (even // GROUP)[None, :]
        scale = tl.load(scales_ptr + at_group, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + at_group, mask=w_mask, other=0).to(tl.float32)
        else:
            zero = 8.0
        low = ((packed & 0xF).to(tl.float32) - zero) * scale
        high = ((packed >> 4).to(tl.float32) - zero) * scale
        x_mask = in_m[:, None] & in_k[None, :]
        x_at = x_ptr + m[:, None] * x_row + even[None, :]
        x_even = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_at + 1, mask=x_mask, other=0.0).to(tl.float32)
        acc += x_even[:, None, :] * low[None, :, :] + x_odd[:, None, :] * high[None, :, :]
    _store(tl.sum(acc, axis=2), bias_ptr, y_ptr, n, in_n, m, in_m, y_row, HAS_BIAS)


@triton.jit
def _store(y, bias_ptr, y_ptr, n, in_n, m, in_m, y_row, HAS_BIAS: tl.constexpr):
    """y [ROWS_PAD, BLOCK_N] (+ bias) into the output rows, in the output's dtype."""
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * y_row + n[None, :], y.to(y_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])
