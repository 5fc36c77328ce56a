"""The int8 KV cache's quantization: `kv_quantize(x) -> (codes, scales)`.

x is f32 [batch, kv_heads, seq, head_dim] (a layer's new keys or values). Each row of head_dim
numbers (one token of one head) gets its own scale, symmetric, from its largest magnitude:

    scales[b, h, t, 0] = max_d |x[b, h, t, d]| / 127
    codes[b, h, t, d]  = round(x[b, h, t, d] / scales[b, h, t, 0])   (i8, in [-127, 127])

and a row of zeros gets scale 0 and codes 0. The cache then holds the codes (i8, one byte per
number) beside the scales (f32 [max_batch, kv_heads, max_seq_len, 1]), both written by `kv_write`
at the call's slots; `attention` reads key (value) slot s as codes[s] * scales[s] (its optional
`k_scales` / `v_scales` inputs). Per token and head, so a row is final once written: no scale is
ever revised by later tokens, and copying a row's slots (prefix caching) copies its scales too.
"""

from __future__ import annotations

import torch

from ..registry import OpDef, OpError, register

KV_CODE_MAX = 127  # symmetric: -127..127 (-128 unused, so negating a code never overflows)


def _kv_quantize_infer(x):
    if x.rank != 4 or x.dtype != "f32":
        raise OpError(f"kv_quantize: x must be f32 [batch, kv_heads, seq, head_dim], got {x}")
    return x.with_dtype("i8"), x.with_shape(x.shape[:3] + (1,))


def kv_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = x.abs().amax(dim=-1, keepdim=True) / KV_CODE_MAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(x / safe).clamp(-KV_CODE_MAX, KV_CODE_MAX).to(torch.int8)
    return codes, scales


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes * scales in f32: the keys or values an int8 cache holds."""
    return codes.to(torch.float32) * scales


register(
    OpDef(
        "kv_quantize",
        ("x",),
        _kv_quantize_infer,
        kv_quantize_reference,
        doc="(codes i8, scales f32 [..., 1]): symmetric int8 per token and head (absmax over head_dim / 127)",
    )
)
