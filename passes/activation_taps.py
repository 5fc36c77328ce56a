"""What a graph's intermediate values look like on real inputs: per-channel mean |x| and mean x^2, and a sample
of rows, gathered by running the reference kernels on calibration tokens.

The data-aware quantizer (awq_scaling.py) needs the inputs of every linear. Adding them as graph
outputs and calling `run_graph` would keep every intermediate of every layer alive and run the
lm_head for nothing, so this walks the nodes itself: it stops after the last tapped value and
drops each intermediate after its last use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch

from kiln.ir import Graph, Value, get_op
from kiln.ir.dims import evaluate
from kiln.ir.interpreter import bind_symbols


@dataclass
class ActivationStats:
    """Channel statistics of one value [..., K] over every calibration token."""

    abs_sum: torch.Tensor
    square_sum: torch.Tensor
    tokens: int = 0
    sample: list[torch.Tensor] = field(default_factory=list)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)

    @property
    def mean_square(self) -> torch.Tensor:
        return self.square_sum / max(self.tokens, 1)

    def rows(self) -> torch.Tensor:
        """The sampled rows, [rows, K]."""
        return torch.cat(self.sample)

    def add(self, x: torch.Tensor, rows_kept: int, generator: torch.Generator) -> None:
        flat = x.reshape(-1, x.shape[-1]).float()
        self.abs_sum += flat.abs().sum(0)
        self.square_sum += flat.double().pow(2).sum(0).float()
        self.tokens += flat.shape[0]
        if rows_kept < flat.shape[0]:
            flat = flat[torch.randperm(flat.shape[0], generator=generator)[:rows_kept]]
        self.sample.append(flat.clone())


def _concrete(attr, bindings):
    if isinstance(attr, tuple):
        return tuple(_concrete(a, bindings) for a in attr)
    return evaluate(attr, bindings) if isinstance(attr, sympy.Expr) else attr


def collect_activation_stats(
    graph: Graph, tokens: torch.Tensor, taps: list[Value], rows_per_sequence: int = 64, seed: int = 0
) -> dict[str, ActivationStats]:
    """Run the stateless forward on each row of `tokens` [sequences, length] (positions 0..length-1)
    and gather `ActivationStats` for each value in `taps`, by value name."""
    tap_ids = {id(v): v for v in taps}
    producing = [i for i, node in enumerate(graph.nodes) if any(id(v) in tap_ids for v in node.outputs)]
    nodes = graph.nodes[: max(producing) + 1] if producing else []
    last_use = {id(v): i for i, node in enumerate(nodes) for v in node.inputs if v is not None}
    stats = {v.name: ActivationStats(torch.zeros(v.type.shape[-1]), torch.zeros(v.type.shape[-1])) for v in taps}
    generator = torch.Generator().manual_seed(seed)
    params = {id(v): graph.weights[name] for name, v in graph.params.items()}
    with torch.no_grad():
        for sequence in tokens:
            feeds = dict(zip((v.name for v in graph.inputs[:2]), (sequence[None], torch.arange(len(sequence))[None])))
            bindings = bind_symbols(graph, feeds)
            env = {id(v): feeds[v.name] for v in graph.inputs[:2]}
            for i, node in enumerate(nodes):
                args = [None if v is None else env.get(id(v), params.get(id(v))) for v in node.inputs]
                attrs = {k: _concrete(a, bindings) for k, a in node.attrs.items()}
                result = get_op(node.op).reference(*args, **attrs)
                for v, t in zip(node.outputs, result if isinstance(result, (tuple, list)) else (result,)):
                    env[id(v)] = t
                    if id(v) in tap_ids:
                        stats[v.name].add(t, rows_per_sequence, generator)
                for v in node.inputs:
                    if v is not None and last_use.get(id(v)) == i:
                        env.pop(id(v), None)
    return stats
