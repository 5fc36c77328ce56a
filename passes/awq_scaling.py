"""awq_scaling: activation-aware weight scaling and clipping before round-to-nearest, in the manner
of AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression", 2023).

Why: a few input channels carry large activations, and the rounding error of the weight columns
they multiply dominates the output error. Multiplying those columns by s > 1 before rounding
(and the input by 1 / s) shrinks their relative error; the other columns of their group pay a
little. The product x @ W.T is unchanged before rounding.

Per group of linears sharing an input x (e.g. a merged q/k/v projection):
1. scale: s = mean|x| ** alpha per input channel, normalized to a geometric mean of 1, with alpha
   picked from a grid to minimize the error of the group's quantized outputs on calibration rows
   (alpha = 0 is plain round-to-nearest, so the search never does worse on those rows). W *= s;
   1 / s is folded into the weight of the `rms_norm` / `add_rms_norm` / `layer_norm` that makes x
   when the group reads all of its output, else applied by a `mul` inserted before the group.
2. clip: per output row and group of `group_size` inputs, the range the grid spans is shrunk by
   the ratio (from a grid) that minimizes that group's output error; the weights are clamped to it.
Linears that round_to_nearest would skip (the lm_head, tied tables) are left alone here too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir import Graph, Node, Value

from .activation_taps import collect_activation_stats
from .quant_schemes import QuantScheme
from .quantize_weights import eligible_weight, embedding_tables, output_projections
from .round_to_nearest import grouped, quantize_weight

SCALE_GRID = 20  # alpha in 0, 0.05, ..., 0.95
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 down to 0.55
NORM_OPS = ("rms_norm", "add_rms_norm", "layer_norm")


@dataclass
class LinearGroup:
    """Linears reading one input, searched with one scale."""

    input: Value
    linears: list[Node]

    def weights(self, graph: Graph) -> list[torch.Tensor]:
        return [graph.weights[n.inputs[1].name] for n in self.linears]


def find_groups(graph: Graph, scheme: QuantScheme) -> list[LinearGroup]:
    """Eligible linears grouped by input, in graph order; weights read elsewhere are left out."""
    skipped = output_projections(graph) | embedding_tables(graph)
    users = graph.users()
    groups: dict[int, LinearGroup] = {}
    for node in graph.nodes:
        weight = node.inputs[1] if node.op == "linear" else None
        if (weight is None or weight.name in skipped or not eligible_weight(graph, weight, scheme)
                or len(users.get(weight, [])) != 1):
            continue
        groups.setdefault(id(node.inputs[0]), LinearGroup(node.inputs[0], [])).linears.append(node)
    return list(groups.values())


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of x @ weight.T and x @ approx.T."""
    return (x @ (approx - weight).T).pow(2).mean()


def search_scale(x: torch.Tensor, mean_abs: torch.Tensor, weight: torch.Tensor,
                 scheme: QuantScheme) -> tuple[torch.Tensor, float]:
    """The per-input-channel scale s minimizing the quantized output error; returns (s, alpha)."""
    group_size = scheme.group_size_for(weight.shape[1])
    best = (float("inf"), None, 0.0)
    for step in range(SCALE_GRID):
        alpha = step / SCALE_GRID
        s = mean_abs.clamp(min=1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        approx = quantize_weight(weight * s, scheme.bits, group_size, scheme.symmetric).dequantize() / s
        error = output_error(x, weight, approx).item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


def search_clip(x: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme, chunk: int = 512) -> torch.Tensor:
    """`weight` clamped per (row, group) to the range shrink that minimizes that group's output error."""
    group_size = scheme.group_size_for(weight.shape[1])
    xg = grouped(x, group_size)  # [rows, groups, group_size]
    clipped = []
    for start in range(0, weight.shape[0], chunk):
        w = weight[start:start + chunk]
        wg = grouped(w, group_size)
        best_error = best_ratio = None
        for ratio in CLIP_RATIOS:
            clip = torch.full(wg.shape[:2], ratio)
            approx = grouped(quantize_weight(w, scheme.bits, group_size, scheme.symmetric, clip).dequantize(), group_size)
            error = torch.einsum("rgk,ngk->rng", xg, wg - approx).pow(2).mean(0)  # [rows of w, groups]
            if best_error is None:
                best_error, best_ratio = error, clip
            else:
                better = error < best_error
                best_error, best_ratio = torch.where(better, error, best_error), torch.where(better, clip, best_ratio)
        clipped.append(_clamp_to_ratio(wg, best_ratio, scheme).reshape(w.shape[0], -1)[:, :w.shape[1]])
    return torch.cat(clipped)


def _clamp_to_ratio(wg: torch.Tensor, ratio: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Clamp grouped weights to the shrunk range round_to_nearest spans with `clip=ratio`."""
    r = ratio[..., None]
    if scheme.symmetric and scheme.bits == 4:
        # The grid spans [-7/8 e, e] for the signed extreme e (scaled by r): clamp to exactly that,
        # so the clamped group's extreme is still e * r and rounding picks the grid searched.
        extreme = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)) * r
        ends = torch.cat((extreme, extreme * -7 / 8), -1)
        return torch.minimum(torch.maximum(wg, ends.amin(-1, keepdim=True)), ends.amax(-1, keepdim=True))
    if scheme.symmetric:
        limit = wg.abs().amax(-1, keepdim=True) * r
        return torch.minimum(torch.maximum(wg, -limit), limit)
    high = wg.amax(-1, keepdim=True).clamp(min=0) * r
    low = wg.amin(-1, keepdim=True).clamp(max=0) * r
    return torch.minimum(torch.maximum(wg, low), high)


def fold_inverse_scale(graph: Graph, group: LinearGroup, s: torch.Tensor) -> None:
    """Make the group read x / s: fold 1 / s into the norm that makes x, or insert a `mul`."""
    users = graph.users()
    norm = group.input.producer
    readers = users.get(group.input, [])
    if (norm is not None and norm.op in NORM_OPS and group.input is norm.outputs[0]
            and all(any(r is n for n in group.linears) for r in readers)
            and not any(v is group.input for v in graph.outputs) and _fold_into_norm(graph, norm, s, users)):
        return
    inverse = graph.add_param(graph.fresh_name(f"{group.input.name}.awq_inverse_scale"), 1.0 / s)
    mul = graph.create("mul", [group.input, inverse])
    first = min(graph.nodes.index(n) for n in group.linears)
    graph.nodes.insert(first, mul)
    for node in group.linears:
        node.inputs[0] = mul.output


def _fold_into_norm(graph: Graph, norm: Node, s: torch.Tensor, users) -> bool:
    """Divide the norm's affine weight (and bias) by s; False where it has none of its own."""
    params = [norm.inputs[1], norm.inputs[2]] if norm.op == "layer_norm" else [norm.inputs[-1]]
    weight = params[0]
    if weight is None or weight.name not in graph.params or len(users.get(weight, [])) != 1:
        return False
    if len(params) > 1 and params[1] is not None and (params[1].name not in graph.params
                                                      or len(users.get(params[1], [])) != 1):
        return False
    offset = norm.attrs.get("offset", 0.0)
    graph.weights[weight.name] = (graph.weights[weight.name] + offset) / s - offset
    if len(params) > 1 and params[1] is not None:
        graph.weights[params[1].name] = graph.weights[params[1].name] / s
    return True


def awq_scale(graph: Graph, scheme: QuantScheme, calibration: torch.Tensor, clip: bool = True,
              rows_per_sequence: int = 64) -> Graph:
    """Scale (and clip) every eligible linear's weight for `scheme`, from the activations of the
    calibration token rows [sequences, length]; rewrites `graph` in place and returns it."""
    groups = find_groups(graph, scheme)
    stats = collect_activation_stats(graph, calibration, [g.input for g in groups], rows_per_sequence)
    alphas = []
    for group in groups:
        x_stats = stats[group.input.name]
        x = x_stats.rows()
        weights = group.weights(graph)
        s, alpha = search_scale(x, x_stats.mean_abs, torch.cat(weights), scheme)
        alphas.append(alpha)
        if alpha > 0:
            fold_inverse_scale(graph, group, s)
            for node, w in zip(group.linears, weights):
                graph.weights[node.inputs[1].name] = w * s
            x = x / s
        if clip:
            for node in group.linears:
                name = node.inputs[1].name
                graph.weights[name] = search_clip(x, graph.weights[name], scheme)
    graph.meta["awq"] = {"groups": len(groups), "scaled": sum(a > 0 for a in alphas), "clip": clip,
                         "calibration_tokens": int(calibration.numel()),
                         "mean_alpha": round(sum(alphas) / max(len(alphas), 1), 3)}
    return graph
