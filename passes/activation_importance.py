"""The importance of each input column of each linear: the mean square of the activations that
meet it on calibration text (llama.cpp's importance matrix, `llama-imatrix`), for the fitted
rounding's error weights (fitted_rounding.py).

A weight column that meets large activations moves the output more per unit of rounding error,
so the fit spends its precision there. Weights read by more than one op (the lm_head of a tied
model, also the embedding table) get no importance: the table's lookup has no activations.
"""

from __future__ import annotations

import torch

from kiln.ir import Graph

from .activation_taps import collect_activation_stats
from .linear_groups import find_groups
from .quant_schemes import QuantScheme


def activation_importance(
    graph: Graph, scheme: QuantScheme, calibration: torch.Tensor, include_embeddings: bool = False
) -> dict[str, torch.Tensor]:
    """Weight name -> mean x^2 per input column [K], from the stateless forward on the token rows
    `calibration` [sequences, length]."""
    groups = find_groups(graph, scheme, include_embeddings)
    stats = collect_activation_stats(graph, calibration, [g.input for g in groups], rows_per_sequence=1)
    return {node.inputs[1].name: stats[group.input.name].mean_square for group in groups for node in group.linears}
