"""`kiln_cuda::gemv`: a decode step's product y = x @ W.T (+ bias) over a half or f32 weight as
Kiln's own Triton kernel (cuda_gemv_kernel.py), for a few rows of x.

Inductor turns a one-row matmul into a reduction under coordinate-descent tuning and fuses what
produces x into it, which on an H200 left the Llama-3.2-1B shape's products at 2.3 TB/s on
average: the down projection recomputed `silu(gate) * up` for every output (1.9 TB/s), the
lm_head the final norm (1.2 TB/s) (bench/results/gpu-h200-profile.md). As a custom op the
product is opaque to Inductor, so x is computed once into a buffer, and the kernel's block sizes
are picked per shape by Triton's autotuner on the GPU (the first call, before the step is
captured as a CUDA graph). On the CPU the op is `F.linear` (the CUDA lowering's tests run there).

cuda_decode_fusion.py puts it in a decode module where KILN_CUDA_DECODE_LINEAR=triton.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from kiln.ir.errors import OptionError

MAX_ROWS = 4  # rows of x a call takes in registers; wider decode batches keep Inductor's form
TILE_LIMIT = 1 << 13  # f32 products a program holds: rows x BLOCK_N x BLOCK_K
# (BLOCK_N, BLOCK_K, warps): narrow blocks for many programs (a 2048-output product), wide K for
# long loads. Few, as each is compiled per shape on a load's first step (Triton's cache keeps them).
CONFIGS = [
    (2, 1024, 4),
    (4, 256, 4),
    (4, 512, 4),
    (8, 256, 4),
    (8, 512, 4),
    (8, 1024, 8),
    (16, 256, 4),
    (16, 512, 8),
    (32, 256, 8),
]


LINEAR_SWITCH = "KILN_CUDA_DECODE_LINEAR"
LINEAR_FORMS = ("inductor", "triton")  # the default first


def decode_linear_form() -> str:
    choice = os.environ.get(LINEAR_SWITCH, LINEAR_FORMS[0])
    if choice not in LINEAR_FORMS:
        raise OptionError(f"{LINEAR_SWITCH}={choice!r} is not a choice. Fix: one of {LINEAR_FORMS}, or unset it.")
    return choice


@torch.library.custom_op("kiln_cuda::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T + bias [N] -> [..., N] in x's dtype (more than MAX_ROWS rows,
    or off the GPU: F.linear)."""
    if x.is_cuda and x.numel() <= MAX_ROWS * x.size(-1):
        return launch_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@gemv.register_fake
def _gemv_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.size(0)))


@functools.cache
def _autotuned():
    """The kernel under Triton's autotuner, keyed by the product's shape (built on first use)."""
    import triton

    from .cuda_gemv_kernel import gemv_kernel

    def fits(configs, named_args, **kwargs):
        rows = named_args["ROWS_PAD"] if "ROWS_PAD" in named_args else kwargs["ROWS_PAD"]
        kept = [c for c in configs if rows * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= TILE_LIMIT]
        return kept or configs[:1]

    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in CONFIGS]
    return triton.autotune(configs, key=["N", "K", "ROWS_PAD"], prune_configs_by={"early_config_prune": fits})(
        gemv_kernel
    )


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block=None) -> torch.Tensor:
    """The Triton kernel over x's rows (at most MAX_ROWS); `block` = (BLOCK_N, BLOCK_K, warps)
    runs one configuration without the autotuner (the interpreter's tests)."""
    import triton

    rows_x = x.reshape(-1, x.size(-1)).contiguous()
    rows, k = rows_x.shape
    n = weight.size(0)
    if rows > MAX_ROWS or weight.stride(1) != 1:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x and a weight contiguous along K")
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    args = (rows_x, weight, bias if bias is not None else weight, y, n, rows_x.stride(0), weight.stride(0), n)
    meta = dict(K=k, ROWS=rows, ROWS_PAD=triton.next_power_of_2(rows), HAS_BIAS=bias is not None)
    if block is None:
        _autotuned()[lambda m: (triton.cdiv(n, m["BLOCK_N"]),)](*args, **meta)
    else:
        from .cuda_gemv_kernel import gemv_kernel

        block_n, block_k, warps = block
        gemv_kernel[(triton.cdiv(n, block_n),)](*args, **meta, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y.reshape(*x.shape[:-1], n)
