"""awq_scaling: activation-aware weight scaling before round-to-nearest, in the manner of AWQ
(Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression", 2023), with
AutoAWQ's "duo" scales that weigh the weights' magnitudes in too.

Why: a few input channels carry large activations, and the rounding error of the weight columns
they multiply dominates the output error. Multiplying those columns by s > 1 before rounding
(and the input by 1 / s) shrinks their relative error; the other columns of their group pay a
little. The product x @ W.T is unchanged before rounding, so this pass alone keeps the results.

Per group of linears sharing an input x (e.g. a merged q/k/v projection):
  s = mean|x| ** alpha / mean(|w| / max|w| of its group) ** (1 - alpha) per input channel,
normalized to a geometric mean of 1, with alpha picked from a grid to minimize the error of the
group's quantized outputs on calibration rows; plain round-to-nearest (s = 1) competes too, so
the search never does worse on those rows. W *= s; 1 / s is folded into the weight of the
`rms_norm` / `add_rms_norm` / `layer_norm` that makes x when the group reads all of its output,
else applied by a `mul` inserted before the group. Linears that round_to_nearest skips (the
lm_head, tied tables) are left alone here too.

Measured on SmolLM2-135M (int4-g64, Moby-Dick, docs/quantization.md): activation-only scales
(mean|x| ** alpha) cut round-to-nearest's perplexity increase by a tenth, duo scales by about
half; AWQ's per-group clipping search, tried as well, lowered each linear's output error but
raised perplexity, so it is not done.
"""

from __future__ import annotations

import torch

from kiln.ir import Graph, Node

from .activation_taps import collect_activation_stats
from .linear_groups import LinearGroup, find_groups
from .quant_schemes import QuantScheme
from .round_to_nearest import grouped, quantize_weight

SCALE_GRID = 20  # alpha in 0, 0.05, ..., 0.95
NORM_OPS = ("rms_norm", "add_rms_norm", "layer_norm")


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of x @ weight.T and x @ approx.T."""
    return (x @ (approx - weight).T).pow(2).mean()


def weight_magnitude(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel, the mean of |w| relative to its group's largest |w| (AutoAWQ's w_mean)."""
    wg = grouped(weight.abs(), group_size)
    relative = wg / (wg.amax(-1, keepdim=True) + 1e-6)
    return relative.reshape(weight.shape[0], -1)[:, : weight.shape[1]].mean(0)


def search_scale(
    x: torch.Tensor, mean_abs: torch.Tensor, weight: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor | None, float | None]:
    """The per-input-channel scale minimizing the quantized output error on rows `x`, and its
    alpha; (None, None) when no scale beats plain round-to-nearest."""
    group_size = scheme.group_size_for(weight.shape[1])
    w_mean = weight_magnitude(weight, group_size)
    rtn = quantize_weight(weight, scheme.bits, group_size, scheme.symmetric).dequantize()
    best = (output_error(x, weight, rtn).item(), None, None)
    for step in range(SCALE_GRID):
        alpha = step / SCALE_GRID
        s = (mean_abs.clamp(min=1e-4).pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        approx = quantize_weight(weight * s, scheme.bits, group_size, scheme.symmetric).dequantize() / s
        error = output_error(x, weight, approx).item()
        if error < best[0]:
            best = (error, s, alpha)
    return best[1], best[2]


def fold_inverse_scale(graph: Graph, group: LinearGroup, s: torch.Tensor) -> None:
    """Make the group read x / s: fold 1 / s into the norm that makes x, or insert a `mul`."""
    norm = group.input.producer
    if (
        norm is not None
        and norm.op in NORM_OPS
        and group.input is norm.outputs[0]
        and all(any(r is n for n in group.linears) for r in group.input.users)
        and not graph.is_output(group.input)
        and _fold_into_norm(graph, norm, s)
    ):
        return
    inverse = graph.add_param(graph.fresh_name(f"{group.input.name}.awq_inverse_scale"), 1.0 / s)
    mul = graph.create("mul", [group.input, inverse])
    graph.insert_before(min(group.linears, key=graph.position), mul)
    for node in group.linears:
        graph.set_input(node, 0, mul.output)


def _fold_into_norm(graph: Graph, norm: Node, s: torch.Tensor) -> bool:
    """Divide the norm's affine weight (and bias) by s; False where it has none of its own."""
    params = [norm.inputs[1], norm.inputs[2]] if norm.op == "layer_norm" else [norm.inputs[-1]]
    weight = params[0]
    if weight is None or weight.name not in graph.params or len(weight.users) != 1:
        return False
    if len(params) > 1 and params[1] is not None and (params[1].name not in graph.params or len(params[1].users) != 1):
        return False
    offset = norm.attrs.get("offset", 0.0)
    graph.weights[weight.name] = (graph.weights[weight.name] + offset) / s - offset
    if len(params) > 1 and params[1] is not None:
        graph.weights[params[1].name] = graph.weights[params[1].name] / s
    return True


def awq_scale(graph: Graph, scheme: QuantScheme, calibration: torch.Tensor, rows_per_sequence: int = 64) -> Graph:
    """Scale every eligible linear's weight for `scheme`, from the activations of the calibration
    token rows [sequences, length]; rewrites `graph` in place and returns it."""
    groups = find_groups(graph, scheme)
    stats = collect_activation_stats(graph, calibration, [g.input for g in groups], rows_per_sequence)
    alphas = []
    for group in groups:
        x_stats = stats[group.input.name]
        weights = group.weights(graph)
        s, alpha = search_scale(x_stats.rows(), x_stats.mean_abs, torch.cat(weights), scheme)
        if s is None:
            continue
        alphas.append(alpha)
        fold_inverse_scale(graph, group, s)
        for node, w in zip(group.linears, weights):
            graph.weights[node.inputs[1].name] = w * s
    graph.meta["awq"] = {
        "groups": len(groups),
        "scaled": len(alphas),
        "calibration_tokens": int(calibration.numel()),
        "mean_alpha": round(sum(alphas) / max(len(alphas), 1), 3),
    }
    return graph
