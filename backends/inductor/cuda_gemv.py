"""`kiln_cuda::gemv` and `kiln_cuda::gemv_int4`: a decode step's product y = x @ W.T (+ bias) as
Kiln's own Triton kernels (cuda_gemv_kernel.py), for a few rows of x, over a half or f32 weight,
int8 codes with a scale per output, or Kiln's int4 codes (in decode, in place of Inductor's
fused reductions and of tinygemm).

Inductor turns a one-row matmul into a reduction under coordinate-descent tuning and fuses what
produces x into it, which on an H200 left the Llama-3.2-1B shape's products at 2.3 TB/s on
average: the down projection recomputed `silu(gate) * up` for every output (1.9 TB/s), the
lm_head the final norm (1.2 TB/s) (bench/results/gpu-h200-profile.md). As a custom op the
product is opaque to Inductor, so x is computed once into a buffer, and the kernel's block sizes
are picked per shape by Triton's autotuner on the GPU (the first call, before the step is
captured as a CUDA graph). On the CPU the ops run the forms they replace (`F.linear`, the int8
per-channel form, `linear_q`'s reference), which the CUDA lowering's tests run there.

cuda_decode_fusion.py puts it in a decode module where KILN_CUDA_DECODE_LINEAR=triton.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.ir.ops.quantized import linear_q_reference

from .cuda_lowerings import linear_int8_channels
from .env_switch import env_choice

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
    return env_choice(LINEAR_SWITCH, LINEAR_FORMS)


@torch.library.custom_op("kiln_cuda::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype; `weight` a float
    tensor, or int8 codes with `scales` [N] applied to the sums (the CUDA lowering's
    linear_int8_channels). More than MAX_ROWS rows, or off the GPU: the unfused forms."""
    if x.is_cuda and x.numel() <= MAX_ROWS * x.size(-1):
        return launch_gemv(x, weight, scales, bias)
    if scales is not None:
        return linear_int8_channels(x, weight, scales, bias)
    return F.linear(x, weight, bias)


@gemv.register_fake
def _gemv_shape(x, weight, scales, bias):
    return x.new_empty((*x.shape[:-1], weight.size(0)))


@torch.library.custom_op("kiln_cuda::gemv_int4", mutates_args=())
def gemv_int4(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """`linear_q` over Kiln's 4-bit codes (kiln.ir.ops.quantized) for x [..., K] -> [..., N]."""
    if x.is_cuda and x.numel() <= MAX_ROWS * x.size(-1):
        return launch_gemv_int4(x, qweight, scales, zeros, bias, group_size)
    return linear_q_reference(x, qweight, scales, zeros, bias, 4, group_size)


@gemv_int4.register_fake
def _gemv_int4_shape(x, qweight, scales, zeros, bias, group_size):
    return x.new_empty((*x.shape[:-1], qweight.size(0)))


def _fits(configs, named_args, **kwargs):
    """The configurations whose f32 tile fits a program's registers for this many rows."""
    rows = {**named_args, **kwargs}["ROWS_PAD"]
    per_code = 2 if "GROUP" in {**named_args, **kwargs} else 1  # int4: a tile holds half the block
    kept = [c for c in configs if rows * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= TILE_LIMIT * per_code]
    return kept or configs[:1]


@functools.cache
def _autotuned(kernel_name: str):
    """A kernel of cuda_gemv_kernel.py under Triton's autotuner, keyed by the product's shape."""
    import triton

    from . import cuda_gemv_kernel

    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in CONFIGS]
    key = ["N", "K", "ROWS_PAD"] + (["GROUP"] if kernel_name == "gemv_int4_kernel" else [])
    tuner = triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": _fits})
    return tuner(getattr(cuda_gemv_kernel, kernel_name))


def _rows(x: torch.Tensor, n: int):
    """x as contiguous rows, the output rows and the row meta-parameters."""
    import triton

    rows_x = x.reshape(-1, x.size(-1)).contiguous()
    rows, k = rows_x.shape
    if rows > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows of x, got {rows}")
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    return rows_x, y, dict(K=k, ROWS=rows, ROWS_PAD=triton.next_power_of_2(rows))


def _launch(kernel_name: str, n: int, args: tuple, meta: dict, block) -> None:
    """The kernel over its output blocks: autotuned, or at `block` = (BLOCK_N, BLOCK_K, warps)
    (the interpreter's tests: the autotuner needs a GPU)."""
    import triton

    from . import cuda_gemv_kernel

    if block is None:
        _autotuned(kernel_name)[lambda m: (triton.cdiv(n, m["BLOCK_N"]),)](*args, **meta)
    else:
        block_n, block_k, warps = block
        kernel = getattr(cuda_gemv_kernel, kernel_name)
        kernel[(triton.cdiv(n, block_n),)](*args, **meta, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)


def launch_gemv(x, weight, scales=None, bias=None, block=None) -> torch.Tensor:
    """`gemv` on the device Triton runs on (at most MAX_ROWS rows of x)."""
    n, weight = weight.size(0), weight.contiguous()  # stored so already: no copy
    rows_x, y, meta = _rows(x, n)
    unused = weight  # a pointer the kernel is given but does not read (its flag is off)
    args = (rows_x, weight, unused if scales is None else scales, unused if bias is None else bias, y, n)
    args += (rows_x.stride(0), weight.stride(0), n)
    _launch("gemv_kernel", n, args, {**meta, "SCALED": scales is not None, "HAS_BIAS": bias is not None}, block)
    return y.reshape(*x.shape[:-1], n)


def launch_gemv_int4(x, qweight, scales, zeros, bias, group_size: int, block=None) -> torch.Tensor:
    """`gemv_int4` on the device Triton runs on (at most MAX_ROWS rows of x)."""
    n = qweight.size(0)
    qweight, scales = qweight.contiguous(), scales.contiguous()  # stored so already: no copies
    zeros = None if zeros is None else zeros.contiguous()
    rows_x, y, meta = _rows(x, n)
    args = (rows_x, qweight, scales, scales if zeros is None else zeros, scales if bias is None else bias, y, n)
    args += (rows_x.stride(0), qweight.stride(0), scales.stride(0), n)
    meta |= {"GROUP": group_size, "HAS_ZEROS": zeros is not None, "HAS_BIAS": bias is not None}
    _launch("gemv_int4_kernel", n, args, meta, block)
    return y.reshape(*x.shape[:-1], n)
