"""mixed_precision: 4-bit weights, except the transformer layers whose 4-bit rounding moves the
model's output most, which stay 8-bit while the weights fit a bytes budget.

Sensitivity of a layer = the mean KL divergence of the next-token distributions (stateless
forward on the first calibration row, 512 tokens, through the interpreter) when that layer's
linears (and experts) alone are rounded to the 4-bit scheme, all else f32. Layers are upgraded to int8 (per
output channel) in order of sensitivity per extra byte while the quantized linears average at
most `budget_bits` bits per weight (scales included); the rest are rounded as the 4-bit scheme
says. A layer is what its weight names say (`...layers.N...`); a linear outside any is a layer of its own.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from kiln.ir import Graph, run_graph

from .quant_schemes import SCHEMES, QuantScheme
from .quantize_weights import eligible_weight, embedding_tables, output_projections, quantize_weights
from .scheme_rounding import round_weight

INT8 = SCHEMES["int8"]
LAYER = re.compile(r"layers?[._](\d+)[._]")


def layer_of(name: str) -> str:
    match = LAYER.search(name)
    return f"layer {match.group(1)}" if match else name


def layer_weights(graph: Graph, scheme: QuantScheme, include_embeddings: bool) -> dict[str, list[str]]:
    """The weight names of the linears (and stacked experts) the scheme quantizes, by layer, in graph order."""
    skipped = set() if include_embeddings else output_projections(graph) | embedding_tables(graph)
    layers: dict[str, list[str]] = {}
    for node in graph.nodes:
        weight = {"linear": 1, "gathered_matmul": 0}.get(node.op)
        if weight is None:
            continue
        value = node.inputs[weight]
        if value.name not in skipped and eligible_weight(graph, value, scheme):
            names = layers.setdefault(layer_of(value.name), [])
            if value.name not in names:
                names.append(value.name)
    return layers


def _log_probs(graph: Graph, tokens: torch.Tensor, weights: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return [
            torch.log_softmax(
                run_graph(graph, [row[None], torch.arange(len(row))[None]], weights)[0][0].double(), dim=-1
            )
            for row in tokens
        ]


def layer_sensitivity(
    graph: Graph, scheme: QuantScheme, layers: dict[str, list[str]], tokens: torch.Tensor
) -> dict[str, float]:
    """Mean KLD from the f32 model of rounding each layer alone to `scheme`, on token rows `tokens`."""
    reference = _log_probs(graph, tokens, graph.weights)
    sensitivity = {}
    for layer, names in layers.items():
        weights = dict(graph.weights)
        for name in names:
            weights[name] = round_weight(weights[name], scheme).dequantize()
        klds = [(p.exp() * (p - q)).sum(-1).mean() for p, q in zip(reference, _log_probs(graph, tokens, weights))]
        sensitivity[layer] = float(torch.stack(klds).mean())
    return sensitivity


def stored_bytes(weight: torch.Tensor, scheme: QuantScheme) -> int:
    return round_weight(weight[:1], scheme).nbytes * weight.shape[0]


def choose_int8_layers(
    graph: Graph,
    layers: dict[str, list[str]],
    sensitivity: dict[str, float],
    scheme: QuantScheme,
    budget_bits: float,
    upgrade: QuantScheme = INT8,
) -> list[str]:
    """The layers to keep at int8 (`upgrade`): most sensitive per extra byte first, while the
    quantized linears' bytes stay within `budget_bits` per weight."""

    def cost(layer: str, s: QuantScheme) -> int:
        return sum(stored_bytes(graph.weights[n], s) for n in layers[layer])

    weights = sum(graph.weights[n].numel() for names in layers.values() for n in names)
    budget = budget_bits * weights / 8 - sum(cost(layer, scheme) for layer in layers)
    extra = {layer: cost(layer, upgrade) - cost(layer, scheme) for layer in layers}
    chosen = []
    for layer in sorted(layers, key=lambda layer: sensitivity[layer] / max(extra[layer], 1), reverse=True):
        if extra[layer] <= budget:
            chosen.append(layer)
            budget -= extra[layer]
    return chosen


def quantize_mixed(
    graph: Graph, scheme: QuantScheme, calibration: torch.Tensor, include_embeddings: bool = False, sequences: int = 1
) -> Graph:
    """Rewrite `graph` in place: `scheme`'s 4-bit grid, int8 for the layers chosen above."""
    base = replace(scheme, method="fit" if scheme.fitted else "rtn")
    upgrade = SCHEMES[scheme.upgrade]
    layers = layer_weights(graph, base, include_embeddings)
    sensitivity = layer_sensitivity(graph, base, layers, calibration[:sequences])
    int8_layers = choose_int8_layers(graph, layers, sensitivity, base, scheme.budget_bits, upgrade)
    overrides = {
        name: upgrade
        for layer in int8_layers
        for name in layers[layer]
        if eligible_weight(graph, graph.params[name], upgrade)
    }
    quantize_weights(graph, scheme, include_embeddings, overrides)
    graph.meta["quantization"].update(
        int8_layers=sorted(int8_layers, key=lambda layer: -sensitivity[layer]),
        upgrade=upgrade.name,
        budget_bits=scheme.budget_bits,
        sensitivity={layer: round(value, 6) for layer, value in sensitivity.items()},
    )
    return graph
