"""Linears that read one input, for the data-aware quantizers (awq_scaling.py, gptq.py): they
share the input's activation statistics, and AWQ searches one input scale per group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir import Graph, Node, Value

from .quant_schemes import QuantScheme
from .quantize_weights import eligible_weight, embedding_tables, output_projections


@dataclass
class LinearGroup:
    """Linears reading one input, in graph order."""

    input: Value
    linears: list[Node]

    def weights(self, graph: Graph) -> list[torch.Tensor]:
        return [graph.weights[n.inputs[1].name] for n in self.linears]


def find_groups(graph: Graph, scheme: QuantScheme, include_embeddings: bool = False) -> list[LinearGroup]:
    """Eligible linears grouped by input, in graph order. Left out: weights read anywhere else,
    and (unless `include_embeddings`) the output projection and tables shared with an embedding."""
    skipped = set() if include_embeddings else output_projections(graph) | embedding_tables(graph)
    groups: dict[int, LinearGroup] = {}
    for node in graph.nodes:
        weight = node.inputs[1] if node.op == "linear" else None
        if (
            weight is None
            or weight.name in skipped
            or not eligible_weight(graph, weight, scheme)
            or len(weight.users) != 1
        ):
            continue
        groups.setdefault(id(node.inputs[0]), LinearGroup(node.inputs[0], [])).linears.append(node)
    return list(groups.values())
