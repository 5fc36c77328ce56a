"""Fitted 4-bit rounding: per group, the scale and offset that minimize the weighted squared error,
in the manner of llama.cpp's k-quants (`make_qkx2_quants`).

Round-to-nearest takes the group's min and max as the grid's ends, so one outlier stretches every
step. Here, per group of `group_size` inputs, candidate grids are tried (the range [min, max]
spread over 15 + t steps for t in -1, -0.9, ..., 1); each assigns codes, then the scale and
offset are refitted to those codes by weighted least squares, and the best of all candidates
(round-to-nearest's included) is kept per group, by the weighted error of what is stored (scale
and zero point rounded to `scale_dtype`, codes rounded again against them).

Weights of the error: `importance` per input column (the mean square of the activations that
meet it, from calibration text: llama.cpp's imatrix), times sqrt(mean w^2 of the row + w^2)
so large weights count more (llama.cpp's weighting with an imatrix); without `importance`,
mean|w| of the group + |w| (llama.cpp's default).

The grid is `(q - z) * scale` with a fractional zero point z (linear_q's float `zeros`), i.e.
llama.cpp's Q4_1 / Q4_K `d * q + m`.
"""

from __future__ import annotations

import torch

from .round_to_nearest import QuantizedWeight, grouped, pack, stored

LEVELS = 15  # 4-bit codes 0..15
STEPS = torch.arange(-10, 11) / 10  # llama.cpp's rmin = -1, rdelta = 0.1, nstep = 20


def error_weights(wg: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """The weight of each value's squared error, [N, groups, group_size]."""
    if importance is None:
        return wg.abs().mean(-1, keepdim=True) + wg.abs()
    row_power = wg.pow(2).mean((-2, -1), keepdim=True)
    return grouped(importance[None].expand(wg.shape[0], -1), wg.shape[-1]) * (row_power + wg.pow(2)).sqrt()


def _snap(wg, scale, zero, scale_dtype):
    """Stored scale and zero point, the codes rounded against them, and the values they give."""
    scale = stored(scale, scale_dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = stored(zero, scale_dtype)
    q = torch.round(wg / scale + zero).clamp_(0, LEVELS)
    return scale, zero, q, (q - zero) * scale


def _refit(wg, weights, q):
    """Scale and offset m minimizing sum weights * (scale * q + m - w)^2 for fixed codes q."""
    sw, sq, sqq = (
        weights.sum(-1, keepdim=True),
        (weights * q).sum(-1, keepdim=True),
        (weights * q * q).sum(-1, keepdim=True),
    )
    sx, sqx = (weights * wg).sum(-1, keepdim=True), (weights * q * wg).sum(-1, keepdim=True)
    det = sw * sqq - sq * sq
    ok = det > 1e-20 * sw * sqq
    safe = torch.where(ok, det, torch.ones_like(det))
    scale = (sw * sqx - sq * sx) / safe
    offset = (sqq * sx - sq * sqx) / safe
    return scale, offset, ok & (scale > 0)


@torch.no_grad()
def fit_weight(
    w: torch.Tensor, group_size: int, importance: torch.Tensor | None = None, scale_dtype: str = "f16"
) -> QuantizedWeight:
    """`w` [N, K] on a 4-bit grid with a fractional zero point per group, fitted as above.
    `importance`: None or per input column, [K]."""
    k = w.shape[1]
    wg = grouped(w.detach().float(), group_size)
    if importance is not None and importance.shape[0] != k:
        raise ValueError(f"importance has {importance.shape[0]} columns, the weight {k}")
    weights = error_weights(wg, None if importance is None else importance.float())
    if k % group_size:  # the padding of the last group counts for nothing
        weights = weights * grouped(torch.ones(1, k), group_size)
    low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    span = (high - low).clamp(min=1e-30)

    def error(values):
        return (weights * (values - wg).pow(2)).sum(-1, keepdim=True)

    best_scale, best_zero, best_q, values = _snap(wg, span / LEVELS, -low / (span / LEVELS), scale_dtype)
    best_error = error(values)
    for step in STEPS:
        q = torch.round((wg - low) * ((LEVELS + step) / span)).clamp_(0, LEVELS)
        scale, offset, ok = _refit(wg, weights, q)
        scale = torch.where(ok, scale, span / LEVELS)
        scale, zero, q, values = _snap(wg, scale, -torch.where(ok, offset, low) / scale, scale_dtype)
        candidate = error(values)
        better = candidate < best_error
        best_error = torch.where(better, candidate, best_error)
        best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
        best_q = torch.where(better, q, best_q)
    return pack(best_q, best_scale, best_zero, 4, k, scale_dtype, float_zero=True)
