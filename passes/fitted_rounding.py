"""Fitted 4-bit rounding: per group, the scale and offset that minimize the weighted squared error,
in the manner of llama.cpp's k-quants (`make_qkx2_quants`).

Round-to-nearest takes the group's min and max as the grid's ends, so one outlier stretches every
step. Here, per group of `group_size` inputs, candidate grids are tried (the range [min, max]
spread over 15 + t steps for t in -1, -0.9, ..., 1); each assigns codes, then the scale and
offset are refitted to those codes by weighted least squares, and the best of all candidates
(round-to-nearest's included) is kept per group by its weighted error; its scale and zero point
are then rounded to `scale_dtype` and the codes rounded again against them.

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


def _weighted_sums(weights: torch.Tensor, wg: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sums over each group of w*q, w*q^2 and w*q*x (w the error weights, x the weights)."""
    wq = weights * q
    return wq.sum(-1, keepdim=True), (wq * q).sum(-1, keepdim=True), (wq * wg).sum(-1, keepdim=True)


@torch.no_grad()
def fit_weight(
    w: torch.Tensor, group_size: int, importance: torch.Tensor | None = None, scale_dtype: str = "f16"
) -> QuantizedWeight:
    """`w` [N, K] on a 4-bit grid with a fractional zero point per group, fitted as above.
    `importance`: None or per input column, [K].

    Each candidate's error comes in closed form from the sums its refit needs
    (sum w (s q + m - x)^2 expanded), so a candidate costs a few passes over the weight; the
    best scale and offset are then rounded to `scale_dtype` and the codes rounded against them."""
    k = w.shape[1]
    if importance is not None and importance.shape[0] != k:
        raise ValueError(f"importance has {importance.shape[0]} columns, the weight {k}")
    wg = grouped(w.detach().float(), group_size)
    weights = error_weights(wg, None if importance is None else importance.float())
    if k % group_size:  # the padding of the last group counts for nothing
        weights = weights * grouped(torch.ones(1, k), group_size)
    low, high = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    span = (high - low).clamp(min=1e-30)
    sw, sx, sxx = (weights.sum(-1, keepdim=True), (weights * wg).sum(-1, keepdim=True),
                   (weights * wg * wg).sum(-1, keepdim=True))  # fmt: skip
    shifted = wg - low

    def error(scale, offset, sq, sqq, sqx):
        return (scale * scale * sqq + 2 * scale * offset * sq - 2 * scale * sqx + offset * offset * sw
                - 2 * offset * sx + sxx)  # fmt: skip

    best_scale, best_offset, best_error = span / LEVELS, low, None
    for step in STEPS:
        q = torch.round(shifted * ((LEVELS + step) / span)).clamp_(0, LEVELS)
        sq, sqq, sqx = _weighted_sums(weights, wg, q)
        if best_error is None:  # round-to-nearest on [min, max] (step 0 assigns its codes) competes
            best_error = error(best_scale, best_offset, *_weighted_sums(
                weights, wg, torch.round(shifted / best_scale).clamp_(0, LEVELS)))  # fmt: skip
        det = sw * sqq - sq * sq
        ok = det > 1e-12 * sw * sqq
        safe = torch.where(ok, det, torch.ones_like(det))
        scale, offset = (sw * sqx - sq * sx) / safe, (sqq * sx - sq * sqx) / safe
        ok &= scale > 0
        candidate = torch.where(ok, error(scale, offset, sq, sqq, sqx), torch.full_like(det, float("inf")))
        better = candidate < best_error
        best_error = torch.where(better, candidate, best_error)
        best_scale, best_offset = torch.where(better, scale, best_scale), torch.where(better, offset, best_offset)
    scale = stored(best_scale, scale_dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = stored(-best_offset / scale, scale_dtype)
    q = torch.round(wg / scale + zero).clamp_(0, LEVELS)
    return pack(q, scale, zero, 4, k, scale_dtype, float_zero=True)
