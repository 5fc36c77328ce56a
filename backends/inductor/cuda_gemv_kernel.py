"""The Triton kernel of `kiln_cuda::gemv` (cuda_gemv.py): y = x @ W.T (+ bias) for a few rows of x
and a weight W [N, K] in its stored layout, one program per BLOCK_N outputs, every row at once.

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
    x_ptr, w_ptr, bias_ptr, y_ptr, N, x_row, w_row, y_row,
    K: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
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
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * y_row + n[None, :], y.to(y_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])
