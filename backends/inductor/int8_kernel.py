"""Kiln's int8 x int8 linear for the CPU: `torch.ops.kiln.linear_q8` (int8_kernel.cpp).

    from kiln.backends.inductor import int8_kernel
    int8_kernel.ensure_loaded()
    packed = int8_kernel.pack_int8_weight(qweight)             # IR int8 [N, K] -> u8 [ceil(N/16), K/4, 64], once
    y = torch.ops.kiln.linear_q8(x, packed, scales, bias)      # ~ F.linear(x, qweight * scales[:, None], bias)

Unlike `kiln::linear_i8` (gemv_kernel.py: each int8 weight widened to f32, f32 FMAs), this op rounds
each row of x to int8 per block of 32 values along K (scale max|x| / 127, as llama.cpp's Q8_0 and
ONNX Runtime's accuracy_level 4 do) and takes integer dot products: AVX-512 VNNI `vpdpbusd` where
the CPU has it, else AVX2 `maddubs`. The result differs from the f32 one by that rounding of x
(`reference` computes exactly what the kernel does, in float64). Rows of x up to 64 run the
kernel, each weight byte read from memory once per call; more (prefill) dequantize the weight
and run one MKL GEMM. Needs K % 32 == 0 (the lowering keeps `linear_i8` otherwise) and weights in
-127..127 (Kiln's quantizer's range). `torch.ops.kiln.linear_q8_use_vnni(False)` forces AVX2.
Built like gemv_kernel.py (same compiler, flags, cache), with a fake implementation for
torch.compile / AOTInductor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.backends.errors import LoweringError

from . import gemv_kernel

_SRC = Path(__file__).with_name("int8_kernel.cpp")
PANEL = 16  # output channels per panel of the packed weight
BLOCK = 32  # values of x per int8 scale; K must be a multiple
LARGE_M = 64  # rows of x above this dequantize + GEMM (kLargeM in the .cpp)


def _register_fake() -> None:
    @torch.library.register_fake("kiln::linear_q8")
    def _linear_q8_fake(x, packed, scales, bias=None):
        torch._check(x.shape[-1] == packed.shape[1] * 4)
        return x.new_empty((*x.shape[:-1], scales.shape[0]))


def ensure_loaded() -> None:
    """Build (once, cached) and load the kernel; registers torch.ops.kiln.linear_q8. Idempotent."""
    gemv_kernel.load_extension(_SRC, "KILN_INT8_KERNELS", "kiln_int8", _register_fake)


def faster_than_f32_activations() -> bool:
    """Whether this CPU runs the VNNI kernel: there linear_q8 is as fast as linear_i8 at one row of
    x and much faster over several; the AVX2 path is 1.1-1.3x slower up to 8 rows (int8_kernel.cpp)."""
    ensure_loaded()
    return bool(torch.ops.kiln.linear_q8_cpu_has_vnni())


def supports(in_features: int) -> bool:
    """Whether linear_q8 takes a weight with this K."""
    return in_features % BLOCK == 0


@torch.no_grad()
def pack_int8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (values -127..127, the IR's `linear_q` bits=8 weight) -> the kernel's u8
    [ceil(N/16), K/4, 64]: panels of 16 channels, each channel's 4 K-consecutive values side by
    side, stored + 128 (VNNI's unsigned operand). Channels past N are zero weights."""
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise LoweringError(
            f"pack_int8_weight: expected an int8 [N, K] weight, got {qweight.dtype} {tuple(qweight.shape)}"
        )
    n, k = qweight.shape
    if not supports(k):
        raise LoweringError(f"pack_int8_weight: K must be a multiple of {BLOCK}, got {k}")
    if (qweight == -128).any():
        raise LoweringError("pack_int8_weight: weights must be in -127..127 (AVX2's sign trick cannot negate -128)")
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.int16)
    padded[:n] = qweight
    shifted = (padded + 128).to(torch.uint8)  # [P*16, K]
    return shifted.view(panels, PANEL, k // 4, 4).permute(0, 2, 1, 3).reshape(panels, k // 4, 4 * PANEL).contiguous()


@torch.no_grad()
def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded as the kernel rounds it: per block of 32, to int8 at scale max|x| / 127
    (computed in float32, ties to even), returned as the float32 values it stands for."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    block_max = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(block_max > 0, torch.tensor(127.0) / block_max, torch.zeros(()))
    q = torch.round(blocks * inverse)
    return (q.double() * (block_max / 127.0).double()).reshape(x.shape)


def reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What linear_q8 computes, in float64: x rounded per block (`round_rows`), int8 weight [N, K]
    dequantized with its per-channel scales."""
    w = qweight.double() * scales.double().reshape(-1, 1)
    return torch.nn.functional.linear(round_rows(x), w, None if bias is None else bias.double())
