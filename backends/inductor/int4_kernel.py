"""Kiln's 4-bit weight-only linear for the CPU: `torch.ops.kiln.linear_q4` (int4_kernel.cpp).

    from kiln.backends.inductor import int4_kernel
    int4_kernel.ensure_loaded()
    y = torch.ops.kiln.linear_q4(x, qweight, scales, zeros, bias, group_size)  # == linear_q's reference
    y = torch.ops.kiln.linear_q4(x, qweight, scales, None, bias, group_size, scales.half())  # decode reads f16 scales
    panels = int4_kernel.pack_panels(qweight, scales, zeros, group_size)  # once, at lowering
    y = torch.ops.kiln.linear_q4_panels(x, panels, qweight, scales, zeros, bias, group_size, decode_scales)

It reads the IR's `linear_q` layout as is (u8 [N, K/2] low nibble first, f32 scales [N, groups],
optional u8 zeros), so the artifact's weights are the kernel's weights. Why a kernel of Kiln's own:
PyTorch's CPU int4 kernel (`aten._weight_int4pack_mm_for_cpu`) takes 6.8 ms for a 3072 x 576
GEMV with f32 activations on this machine, twelve times the 0.57 ms of the fp32 weight (one
thread, `time.thread_time`), and its int8 one (`aten._weight_int8pack_mm`) seven times.
Needs AVX2 + FMA + F16C (every AVX2 CPU has F16C), K a multiple of 64 and group_size 32 or a
multiple of 64. `linear_q4_panels` is linear_q4 with the weight also packed into panels of 16
rows (`pack_panels`), which 2..128 rows of x read as they lie instead of staging them per call
(int4_panels.h); one row and prefill read the IR's layout as linear_q4 does. Built like
gemv_kernel.py (same compiler, flags, cache directory), with fake implementations for
torch.compile / AOTInductor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.backends.errors import LoweringError

from . import gemv_kernel

_SRC = Path(__file__).with_name("int4_kernel.cpp")


def _register_fake() -> None:
    @torch.library.register_fake("kiln::linear_q4")
    def _linear_q4_fake(x, qweight, scales, zeros, bias, group_size, decode_scales=None):
        torch._check(x.shape[-1] == qweight.shape[1] * 2)
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    @torch.library.register_fake("kiln::linear_q4_panels")
    def _linear_q4_panels_fake(x, panels, qweight, scales, zeros, bias, group_size, decode_scales=None):
        torch._check(x.shape[-1] == qweight.shape[1] * 2)
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))


PANEL_ROWS = 16  # weight rows per packed panel (int4_panels.h)
BLOCK = 32  # weights per block: one scale and one int8 scale of x each


def panel_bytes(k: int, zero_points: bool) -> int:
    """Bytes of one packed panel: per block, 16 rows' codes (256), scales (f16, or f32 with zero
    points) and zero points (u8), padded to 64 (kiln_q4_panel_bytes)."""
    blocks = k // BLOCK
    return -(-blocks * (256 + (16 * 4 + 16 if zero_points else 16 * 2)) // 64) * 64


def _per_block(values: torch.Tensor, k: int, group_size: int, panels: int) -> torch.Tensor:
    """[N, G] group values -> [panels, blocks, 16]: each block's value, 16 rows per panel (rows past
    N zero)."""
    n, blocks = values.shape[0], k // BLOCK
    per_block = values.repeat_interleave(group_size // BLOCK, dim=1)[:, :blocks]
    padded = values.new_zeros(panels * PANEL_ROWS, blocks)
    padded[:n] = per_block
    return padded.view(panels, PANEL_ROWS, blocks).transpose(1, 2)


@torch.no_grad()
def pack_panels(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """The IR's int4 linear_q weight (u8 [N, K/2] codes, scales [N, G], u8 zero points or None) ->
    u8 [ceil(N/16), panel_bytes]: panels of 16 rows as int4_panels.h reads them (codes as
    [blocks][dword j][row][4 bytes], then each block's scales (f16 without zero points, as decode
    reads them, else f32), then zero points), so that no call restages the weights."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if k % 64 or group_size % BLOCK or (zeros is not None and zeros.dtype != torch.uint8):
        raise LoweringError(
            f"pack_panels: needs K % 64 == 0, group_size % 32 == 0 and u8 zero points, got K={k}, "
            f"group_size={group_size}, zeros {None if zeros is None else zeros.dtype}"
        )
    panels, blocks = -(-n // PANEL_ROWS), k // BLOCK
    codes = torch.zeros(panels * PANEL_ROWS, k // 2, dtype=torch.uint8)
    codes[:n] = qweight
    # dwords moved whole (4x fewer elements to copy than bytes)
    dwords = codes.view(torch.int32).view(panels, PANEL_ROWS, blocks, 4).permute(0, 2, 3, 1)
    codes = dwords.contiguous().view(torch.uint8).reshape(panels, -1)
    scale_type = torch.float16 if zeros is None else torch.float32
    parts = [codes, _per_block(scales.to(scale_type), k, group_size, panels).reshape(panels, -1).view(torch.uint8)]
    if zeros is not None:
        parts.append(_per_block(zeros, k, group_size, panels).reshape(panels, -1))
    packed = torch.cat(parts, dim=1)
    return torch.nn.functional.pad(packed, (0, panel_bytes(k, zeros is not None) - packed.shape[1])).contiguous()


def ensure_loaded() -> None:
    """Build (once, cached) and load the kernel; registers torch.ops.kiln.linear_q4. Idempotent."""
    gemv_kernel.load_extension(_SRC, "KILN_INT4_KERNELS", "kiln_int4", _register_fake)
