"""One weight rounded as a scheme says: round-to-nearest (round_to_nearest.py) or fitted
(fitted_rounding.py), on the scheme's grid, group size and scale dtype."""

from __future__ import annotations

import torch

from .fitted_rounding import fit_weight
from .quant_schemes import QuantScheme
from .round_to_nearest import QuantizedWeight, quantize_weight


def round_weight(w: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """`w` [N, K] in linear_q's layout under `scheme` (its AWQ scaling, if any, already applied);
    `importance` [K] weighs the fitted rounding's error per input column. Stacked experts
    [E, N, K] are rounded as one [E * N, K] matrix (every row's groups are its own), then stacked back."""
    if w.dim() == 3:
        q = round_weight(w.flatten(0, 1), scheme, importance)
        parts = (None if t is None else t.view(*w.shape[:2], -1) for t in (q.qweight, q.scales, q.zeros))
        return QuantizedWeight(*parts, q.bits, q.group_size)
    group_size = scheme.group_size_for(w.shape[1])
    if scheme.fitted:
        return fit_weight(w, group_size, importance, scale_dtype=scheme.scale_dtype)
    return quantize_weight(
        w, scheme.bits, group_size, scheme.symmetric, scale_dtype=scheme.scale_dtype, float_zero=scheme.float_zero
    )
