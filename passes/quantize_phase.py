"""The pipeline's `quantize` phase: the passes a scheme name (`options.quantize`) asks for.

none / None        -> no pass
int8, int4-g64 ... -> quantize_weights (round-to-nearest)
int4-g64-awq ...   -> awq_scaling (needs calibration tokens), then quantize_weights
int4-g32-fit ...   -> quantize_weights (fitted rounding)
int4-g32-fit-imatrix ... -> the same, each column's error weighted by its calibration activations
int4-mixed         -> awq_scaling, then mixed_precision (int8 for the most sensitive layers)
int4-fit-mixed     -> mixed_precision (fitted rounding, int8-g32 for the most sensitive layers)
"""

from __future__ import annotations

import torch

from kiln.ir.errors import KilnError

from .activation_importance import activation_importance
from .awq_scaling import awq_scale
from .manager import Pass
from .mixed_precision import quantize_mixed
from .quant_schemes import get_scheme
from .quantize_weights import quantize_weights


class CalibrationError(KilnError, ValueError):
    """A data-aware scheme was asked for without calibration tokens."""


def quantization_passes(options, calibration: torch.Tensor | None = None) -> list[Pass]:
    """The passes for `options.quantize` (a scheme name, "none" or None) and
    `options.quantize_embeddings`; `calibration` is token ids [sequences, length] for awq schemes."""
    name = getattr(options, "quantize", None)
    if name in (None, "none"):
        return []
    scheme = get_scheme(name)
    include_embeddings = bool(getattr(options, "quantize_embeddings", False))
    passes = []
    if scheme.needs_calibration:
        if calibration is None or calibration.dim() != 2 or calibration.numel() == 0:
            raise CalibrationError(
                f"scheme {name!r} measures activations or sensitivities on calibration text: "
                "give calibration token ids [sequences, length] (kiln.compile does this from "
                "--calibration FILE, or the bundled Moby-Dick chapters by default)"
            )
        tokens = calibration.to(torch.int64)
    if scheme.awq:
        passes.append(Pass("awq_scaling", lambda graph: awq_scale(graph, scheme, tokens)))  # exact: x / s, W * s
    if scheme.mixed:
        passes.append(
            Pass(
                "mixed_precision",
                lambda graph: quantize_mixed(graph, scheme, tokens, include_embeddings),
                approximate=True,
            )
        )
        return passes

    def quantize(graph):
        importance = activation_importance(graph, scheme, tokens, include_embeddings) if scheme.importance else None
        return quantize_weights(graph, scheme, include_embeddings, importance=importance)

    passes.append(Pass("quantize_weights", quantize, approximate=True))
    return passes
