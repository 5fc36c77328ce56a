"""Round-to-nearest quantization of one weight matrix into the layout of `linear_q`
(kiln/ir/ops/quantized.py): W [N, K] f32 -> qweight, scales [N, groups], zeros [N, groups] or None.

Grids, per group of `group_size` input columns:
- 8-bit symmetric: scale = max|w| / 127, q = round(w / scale) in [-127, 127].
- 4-bit symmetric: the value of largest magnitude, m, maps to -8 (scale = m / -8, which may be
  negative), so both ends of the 16 levels are used (as in llama.cpp's Q4_0 and ONNX Runtime's
  blockwise quantizer); q = round(w / scale) + 8 clamped to [0, 15].
- 4-bit asymmetric: the range [min(w, 0), max(w, 0)] spans 15 steps; the zero point
  z = round(-min / scale) makes 0.0 exact; q = round(w / scale) + z clamped to [0, 15].
- 4-bit asymmetric with a float zero point (`float_zero`): the range [min(w), max(w)] spans 15
  steps and z = -min / scale is kept fractional (stored like the scales), so the grid's offset
  is free (llama.cpp's Q4_1: `d * q + m`).
Scales (and float zero points) are stored as `scale_dtype`, f32 or f16; the codes are rounded
against the stored values, so dequantizing gives exactly the grid they were chosen on.
`clip` (per group, in (0, 1]) shrinks the range before rounding: clipping a few outliers can
lower the error of everything else (the AWQ pass searches for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir.ops.quantized import dequantize, group_count, pack_int4

from .quant_schemes import UnknownSchemeError

TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16}


@dataclass
class QuantizedWeight:
    """A weight in linear_q's layout (see kiln/ir/ops/quantized.py)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.zeros, self.bits, self.group_size)

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.zeros)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, groups, group_size], the last group zero-padded."""
    n, k = w.shape
    groups = group_count(k, group_size)
    return torch.nn.functional.pad(w, (0, groups * group_size - k)).view(n, groups, group_size)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero group: any scale works


def stored(value: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """`value` rounded to `scale_dtype` and back to f32 (what the backends will multiply by)."""
    return value.to(TORCH_DTYPES[scale_dtype]).float()


@torch.no_grad()
def quantize_weight(
    w: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    clip: torch.Tensor | None = None,
    scale_dtype: str = "f32",
    float_zero: bool = False,
) -> QuantizedWeight:
    """Round-to-nearest `w` [N, K] on the grid above. `clip`: None or [N, groups] ratios."""
    if bits not in (4, 8) or (bits == 8 and not symmetric) or (float_zero and symmetric):
        raise UnknownSchemeError(
            f"supported grids: 8-bit symmetric, 4-bit symmetric or asymmetric (integer or float zero point); got "
            f"{bits}-bit {'symmetric' if symmetric else 'asymmetric'}{' with a float zero point' * float_zero}. "
            "Fix: use a scheme of kiln.passes.quant_schemes."
        )
    wg = grouped(w.detach().float(), group_size)
    ratio = 1.0 if clip is None else clip[..., None]
    zeros = None
    if bits == 8:
        scales = _nonzero(stored(wg.abs().amax(-1, keepdim=True) * ratio / 127, scale_dtype))
        q = torch.round(wg / scales).clamp_(-127, 127)
    elif symmetric:
        extreme = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)) * ratio
        scales = _nonzero(stored(extreme / -8, scale_dtype))
        q = (torch.round(wg / scales) + 8).clamp_(0, 15)
    elif float_zero:
        high, low = wg.amax(-1, keepdim=True) * ratio, wg.amin(-1, keepdim=True) * ratio
        scales = _nonzero(stored((high - low) / 15, scale_dtype))
        zeros = stored(-low / scales, scale_dtype)
        q = torch.round(wg / scales + zeros).clamp_(0, 15)
    else:
        high = wg.amax(-1, keepdim=True).clamp(min=0) * ratio
        low = wg.amin(-1, keepdim=True).clamp(max=0) * ratio
        scales = _nonzero(stored((high - low) / 15, scale_dtype))
        zeros = torch.round(-low / scales).clamp_(0, 15)
        q = (torch.round(wg / scales) + zeros).clamp_(0, 15)
    return pack(q, scales, zeros, bits, w.shape[1], scale_dtype, float_zero)


def pack(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    in_features: int,
    scale_dtype: str = "f32",
    float_zero: bool = False,
) -> QuantizedWeight:
    """Codes q [N, groups, group_size] and scales / zeros [N, groups, 1] in linear_q's layout: 4-bit
    codes packed, integer zero points u8, scales and float zero points in `scale_dtype`."""
    n, _, group_size = q.shape
    q = q.reshape(n, -1)[:, :in_features]
    qweight = pack_int4(q.to(torch.uint8)) if bits == 4 else q.to(torch.int8)
    dtype = TORCH_DTYPES[scale_dtype]
    if zeros is not None:
        zeros = zeros.squeeze(-1).to(dtype if float_zero else torch.uint8).contiguous()
    return QuantizedWeight(qweight.contiguous(), scales.squeeze(-1).to(dtype).contiguous(), zeros, bits, group_size)


def fits(in_features: int, bits: int, group_size: int) -> bool:
    """Whether a [N, in_features] weight can take this grid (4-bit packs pairs: K and groups even)."""
    return bits == 8 or (in_features % 2 == 0 and group_size % 2 == 0)
