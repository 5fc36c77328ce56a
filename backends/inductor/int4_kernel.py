"""Kiln's 4-bit weight-only linear for the CPU: `torch.ops.kiln.linear_q4` (int4_kernel.cpp).

    from kiln.backends.inductor import int4_kernel
    int4_kernel.ensure_loaded()
    y = torch.ops.kiln.linear_q4(x, qweight, scales, zeros, bias, group_size)  # == linear_q's reference
    y = torch.ops.kiln.linear_q4(x, qweight, scales, None, bias, group_size, scales.half())  # decode reads f16 scales

It reads the IR's `linear_q` layout as is (u8 [N, K/2] low nibble first, f32 scales [N, groups],
optional u8 zeros), so the artifact's weights are the kernel's weights. Why a kernel of Kiln's own:
PyTorch's CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`) takes 6.8 ms for a 3072 x 576
GEMV with f32 activations on this machine, twelve times the 0.57 ms of the fp32 weight (one
thread, `time.thread_time`), and its int8 one (`aten._weight_int8pack_mm`) seven times.
Needs AVX2 + FMA + F16C (every AVX2 CPU has F16C), K a multiple of 64 and group_size 32 or a
multiple of 64. Built like gemv_kernel.py (same compiler,
flags, cache directory), with a fake implementation for torch.compile / AOTInductor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import gemv_kernel

_SRC = Path(__file__).with_name("int4_kernel.cpp")


def _register_fake() -> None:
    @torch.library.register_fake("kiln::linear_q4")
    def _linear_q4_fake(x, qweight, scales, zeros, bias, group_size, decode_scales=None):
        torch._check(x.shape[-1] == qweight.shape[1] * 2)
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def ensure_loaded() -> None:
    """Build (once, cached) and load the kernel; registers torch.ops.kiln.linear_q4. Idempotent."""
    gemv_kernel.load_extension(_SRC, "KILN_INT4_KERNELS", "kiln_int4", _register_fake)
