"""The CUDA forms of Kiln's quantized linears, for graphs the Inductor backend runs on a GPU.

- 4-bit in a bf16/f16 graph, groups of 32, 64, 128 or 256, N % 8 == 0 -> torch's tinygemm
  kernel (`aten._weight_int4pack_mm`, bf16 activations). Kiln's codes (element 2j in the low
  nibble) are repacked once at lowering by `aten._convert_weight_to_int4pack`, and each group's
  (q - z) * s becomes tinygemm's (q - 8) * s + m with m = (8 - z) * s, exact up to s and m in bf16.
- 8-bit per output channel -> F.linear(x, codes.to(x.dtype)) * scales: under Inductor's
  coordinate-descent tuning a one-row matmul is a reduction that converts each code as it reads
  it, so decode reads one byte per weight (gpt-fast's int8 form).
- anything else (an f32 graph's 4-bit weights, other group sizes) -> dequantize + F.linear, which
  Inductor compiles like the rest of the graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ir.ops.quantized import SYMMETRIC_ZERO, expand_groups, unpack_int4

TINYGEMM_GROUPS = (32, 64, 128, 256)


def linear_int8_channels(x, qweight, scales, bias):
    """x @ (codes * scale per output channel).T (+ bias), the scale applied after the sum in f32
    (which also keeps Inductor's CPU-only bf16 `_weight_int8pack_mm` pattern from matching)."""
    out = (F.linear(x, qweight.to(x.dtype)) * scales.float()).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def linear_int4_tinygemm(x, packed, scales_and_zeros, bias, group_size: int):
    """tinygemm's bf16 x int4 matmul over x's last dim, back in x's dtype."""
    flat = x.reshape(-1, x.size(-1)).to(torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm(flat, packed, group_size, scales_and_zeros)
    out = out.reshape(*x.shape[:-1], out.size(-1)).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def inner_k_tiles(k: int) -> int | None:
    """The widest k-tiling tinygemm packs K into (K a multiple of 16 x tiles), or None."""
    return next((tiles for tiles in (8, 4, 2) if k % (tiles * 16) == 0), None)


def tinygemm_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros, group_size: int, device: str):
    """(packed codes, scales_and_zeros) of Kiln's int4 weight for `_weight_int4pack_mm`."""
    k = qweight.shape[1] * 2
    swapped = ((qweight & 0x0F) << 4) | (qweight >> 4)  # tinygemm reads element 2j in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.to(device).contiguous(), inner_k_tiles(k))
    groups = scales.shape[1]
    s = scales.float().reshape(-1, groups)
    z = torch.full_like(s, SYMMETRIC_ZERO[4]) if zeros is None else zeros.float().reshape(-1, groups)
    offsets = (SYMMETRIC_ZERO[4] - z) * s
    scales_and_zeros = torch.stack([s, offsets], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_and_zeros.to(device)


def dequantized_tinygemm_weight(qweight, scales, zeros, group_size: int) -> torch.Tensor:
    """The f32 weight tinygemm computes with (scales and offsets rounded to bf16), for tests."""
    k = qweight.shape[1] * 2
    z = torch.full_like(scales.float(), SYMMETRIC_ZERO[4]) if zeros is None else zeros.float()
    s = scales.float().to(torch.bfloat16).float()
    offsets = ((SYMMETRIC_ZERO[4] - z) * scales.float()).to(torch.bfloat16).float()
    q = unpack_int4(qweight).float()
    return (q - SYMMETRIC_ZERO[4]) * expand_groups(s, group_size, k) + expand_groups(offsets, group_size, k)


def _tinygemm_applies(b, node, qweight, group_size: int) -> bool:
    return (
        b.device.startswith("cuda")
        and torch.cuda.is_available()
        and node.inputs[0].type.dtype in ("bf16", "f16")
        and qweight is not None
        and group_size in TINYGEMM_GROUPS
        and qweight.shape[0] % 8 == 0
        and inner_k_tiles(qweight.shape[1] * 2) is not None
    )


def lower_linear_q_cuda(b, node, args, attrs):
    """`linear_q` for a CUDA graph: tinygemm (4-bit), the per-channel int8 form, or None (the
    caller dequantizes)."""
    bits, group_size = attrs["bits"], attrs["group_size"]
    qweight, scales = b.constant(args[1]), b.constant(args[2])
    zeros = None if args[3] is None else b.constant(args[3])
    if bits == 8 and qweight is not None and group_size == qweight.shape[1] and args[3] is None:
        return b.call(linear_int8_channels, args[0], args[1], b.method("reshape", args[2], [-1]), args[4])
    if bits == 4 and scales is not None and (args[3] is None or zeros is not None):
        if _tinygemm_applies(b, node, qweight, group_size):
            packed, scales_and_zeros = tinygemm_weight(qweight, scales, zeros, group_size, b.device)
            name = node.inputs[1].name
            return b.call(
                linear_int4_tinygemm,
                args[0],
                b.add_constant(name + ".int4pack", packed),
                b.add_constant(name + ".scales_and_zeros", scales_and_zeros),
                args[4],
                group_size,
            )
    return None
