"""The CUDA forms of Kiln's quantized linears, for graphs the Inductor backend runs on a GPU.

- 4-bit in a bf16/f16 graph, groups of 32, 64, 128 or 256, N % 8 == 0 -> torch's tinygemm
  kernel (`aten._weight_int4pack_mm`, bf16 activations) for calls of up to 16 rows; longer ones
  dequantize the weight and run a GEMM. Kiln's codes (element 2j in the low
  nibble) are repacked once at lowering by `aten._convert_weight_to_int4pack`, and each group's
  (q - z) * s becomes tinygemm's (q - 8) * s + m with m = (8 - z) * s, exact up to s and m in bf16.
- 8-bit per output channel -> F.linear(x, codes.to(x.dtype)) * scales: under Inductor's
  coordinate-descent tuning a one-row matmul is a reduction that converts each code as it reads
  it, so decode reads one byte per weight (gpt-fast's int8 form).
- anything else (an f32 graph's 4-bit weights, other group sizes) -> dequantize + F.linear, which
  Inductor compiles like the rest of the graph.
Attention over the cache keeps GQA grouped without copies: the query heads that share a kv head
become rows of one query block ([batch, kv_heads, groups x seq, head_dim]), so each key and value
is read once a step (SDPA's enable_gqa falls back to copying K and V per query head). Decode
spells it as two matmuls and a softmax in f32 that Inductor fuses (KILN_CUDA_DECODE_ATTENTION=sdpa:
SDPA's kernel, to compare); several tokens go through SDPA's memory-efficient kernel with the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ir.ops.attention import tree_visibility
from kiln.ir.ops.quantized import SYMMETRIC_ZERO, expand_groups, linear_q_reference, unpack_int4

from .composite_ops import scale_and_positions, visible_keys
from .env_switch import env_choice
from .lower_to_fx import register_attention_lowering

TINYGEMM_GROUPS = (32, 64, 128, 256)


def linear_int8_channels(x, qweight, scales, bias):
    """x @ (codes * scale per output channel).T (+ bias), the scale applied after the sum in f32
    (which also keeps Inductor's CPU-only bf16 `_weight_int8pack_mm` pattern from matching)."""
    out = (F.linear(x, qweight.to(x.dtype)) * scales.float()).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


TINYGEMM_ROWS = 16  # tinygemm is a kernel for few rows; more (prompts) dequantize and run a GEMM


def linear_int4_tinygemm(x, packed, scales_and_zeros, bias, group_size: int):
    """tinygemm's bf16 x int4 matmul over x's last dim, back in x's dtype."""
    flat = x.reshape(-1, x.size(-1)).to(torch.bfloat16)
    out = torch.ops.aten._weight_int4pack_mm(flat, packed, group_size, scales_and_zeros)
    out = out.reshape(*x.shape[:-1], out.size(-1)).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def linear_int4_cuda(x, packed, scales_and_zeros, qweight, scales, zeros, bias, group_size: int):
    """Up to TINYGEMM_ROWS rows of x through tinygemm (decode, verification); more through the
    weight dequantized in x's dtype and a GEMM (a prompt: tinygemm ran pp512 at a fifth of bf16)."""
    if x.numel() // x.size(-1) <= TINYGEMM_ROWS:
        return linear_int4_tinygemm(x, packed, scales_and_zeros, bias, group_size)
    return linear_q_reference(x, qweight, scales, zeros, bias, 4, group_size)


def inner_k_tiles(k: int) -> int | None:
    """The widest k-tiling tinygemm packs K into (K a multiple of 16 x tiles), or None."""
    return next((tiles for tiles in (8, 4, 2) if k % (tiles * 16) == 0), None)


def tinygemm_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros, group_size: int, device: str):
    """(packed codes, scales_and_zeros) of Kiln's int4 weight for `_weight_int4pack_mm`."""
    k = qweight.shape[1] * 2
    swapped = ((qweight & 0x0F) << 4) | (qweight >> 4)  # tinygemm reads element 2j in the high nibble
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.to(device).contiguous(), inner_k_tiles(k))
    s, offsets = tinygemm_groups(scales, zeros)
    scales_and_zeros = torch.stack([s, offsets], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros.to(device)


def tinygemm_groups(scales: torch.Tensor, zeros) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (s, m) [N, groups] with (q - z) * s = (q - 8) * s + m: m = (8 - z) * s."""
    s = scales.float()
    z = torch.full_like(s, SYMMETRIC_ZERO[4]) if zeros is None else zeros.float()
    return s.to(torch.bfloat16), ((SYMMETRIC_ZERO[4] - z) * s).to(torch.bfloat16)


def dequantized_tinygemm_weight(qweight, scales, zeros, group_size: int) -> torch.Tensor:
    """The f32 weight tinygemm computes with (scales and offsets rounded to bf16), for tests."""
    k = qweight.shape[1] * 2
    s, offsets = (t.float() for t in tinygemm_groups(scales, zeros))
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
                linear_int4_cuda,
                args[0],
                b.add_constant(name + ".int4pack", packed),
                b.add_constant(name + ".scales_and_zeros", scales_and_zeros),
                *args[1:5],
                group_size,
            )
    return None


ATTENTION_SWITCH = "KILN_CUDA_DECODE_ATTENTION"
ATTENTION_FORMS = ("matmul", "sdpa", "fused")  # the default first; fused: cuda_decode_fusion.py


def decode_attention_form() -> str:
    return env_choice(ATTENTION_SWITCH, ATTENTION_FORMS)


def grouped_attention(q, k, v, positions, tree, scale: float, window: int, decode_sdpa: bool = False):
    """Attention of q [batch, heads, seq, dim] over the first `batch` rows of the cache, each
    query seeing the slots up to its position (and its tree's ancestors), GQA kept grouped.
    `decode_sdpa`: one token per row through SDPA's kernel too, instead of two matmuls."""
    batch, heads, seq, dim = q.shape
    k, v = k[:batch], v[:batch]
    kv_heads, keys = k.size(1), k.size(2)
    groups = heads // kv_heads
    visible = visible_keys(q, k, positions, True, window)
    if tree is not None:
        visible = visible & tree_visibility(positions, tree, keys)
    visible = visible.unsqueeze(2).expand(-1, -1, groups, -1, -1).reshape(visible.size(0), 1, groups * seq, keys)
    grouped = q.reshape(batch, kv_heads, groups * seq, dim)
    if seq == 1 and not decode_sdpa:
        scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * scale
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)
    else:
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=visible, scale=scale)
    return out.reshape(batch, heads, seq, dim)


def lower_attention_cuda(b, node, args, attrs):
    """`attention` over a static cache on a GPU (positions given; no extra mask, softcap, ALiBi
    or int8 cache: those keep the composite lowering)."""
    q, _, _, mask, positions, _, k_scales, _ = node.inputs
    if b.on_cpu or mask is not None or positions is None or k_scales is not None:
        return None
    if attrs["softcap"] or attrs["alibi"] or not isinstance(q.type.shape[3], int):
        return None
    if node.inputs[1].producer is not None and node.inputs[1].producer.op == "kv_pages":
        return None  # a paged pool's gathered slots: the composite lowering
    scale, position_ids = scale_and_positions(b, node, args, attrs)
    window, sdpa = int(attrs["window"] or 0), decode_attention_form() == "sdpa"
    return b.call(grouped_attention, args[0], args[1], args[2], position_ids, args[5], scale, window, sdpa)


register_attention_lowering(lower_attention_cuda)
