"""quantize_weights: replace each eligible `linear` by `linear_q` with its weight quantized
round-to-nearest or fitted, as a named scheme says (passes/quant_schemes.py, scheme_rounding.py),
and each `gathered_matmul` of stacked experts by `gathered_matmul_q` (every expert on the same grid).

Eligible: a `linear` whose weight is a 2-D f32, f16 or bf16 parameter, or a `gathered_matmul` whose
experts are a 3-D f32 parameter [experts, out, in], that the grid fits (4-bit needs an even K).
Half-precision weights (a model captured in f16 or bf16) are rounded from their f32 values, so the
codes and scales are the ones the same weights in f32 would get; `linear_q` then computes in its
input's dtype, and `embedding_q` gets `dtype`, the table's. The output projection (lm_head, the
linear that makes the logits) and the token embedding share one table in tied models; both stay
unquantized unless `include_embeddings`, which quantizes the lm_head and turns `embedding` into
`embedding_q` (tied: both read one quantized table). A parameter read by several linears is
quantized once. The float weights nothing reads any more are dropped.
`graph.meta["quantization"]` records the scheme and what was quantized.
"""

from __future__ import annotations

import torch

from kiln.ir import Graph, Value

from .dce import eliminate_dead_code
from .quant_schemes import QuantScheme
from .round_to_nearest import QuantizedWeight, fits
from .scheme_rounding import round_weight


def output_projections(graph: Graph) -> set[str]:
    """Names of the weights of linears whose result flows, through shape ops only, into a graph output."""
    shape_ops = {"reshape", "slice", "cast", "permute"}
    outputs = {id(v) for v in graph.outputs}
    names = set()
    for node in graph.nodes:
        if node.op != "linear":
            continue
        value = node.output
        while id(value) not in outputs and len(value.users) == 1 and value.users[0].op in shape_ops:
            value = value.users[0].output
        if id(value) in outputs:
            names.add(node.inputs[1].name)
    return names


def embedding_tables(graph: Graph) -> set[str]:
    return {n.inputs[0].name for n in graph.nodes if n.op == "embedding" and n.inputs[0].name in graph.params}


QUANTIZABLE_DTYPES = ("f32", "f16", "bf16")  # rounded from their f32 values alike


def eligible_weight(graph: Graph, value: Value, scheme: QuantScheme) -> bool:
    """A 2-D float parameter (a linear's weight, an embedding table) or a 3-D one (stacked experts)
    whose in-features (last dim) the scheme's grid fits."""
    t = value.type
    return (
        value.name in graph.params
        and t.dtype in QUANTIZABLE_DTYPES
        and t.rank in (2, 3)
        and isinstance(t.shape[-1], int)
        and fits(t.shape[-1], scheme.bits, scheme.group_size_for(t.shape[-1]))
    )


class WeightQuantizer:
    """Quantizes each parameter once and adds its parts to the graph as parameters."""

    def __init__(
        self,
        graph: Graph,
        scheme: QuantScheme,
        overrides: dict[str, QuantScheme] | None = None,
        importance: dict[str, torch.Tensor] | None = None,
    ):
        self.graph, self.scheme, self.overrides = graph, scheme, overrides or {}
        self.importance = importance or {}
        self.done: dict[str, tuple[Value, Value, Value | None]] = {}
        self.bytes_before = self.bytes_after = 0

    def params_for(self, weight: Value) -> tuple[Value, Value, Value | None]:
        if weight.name not in self.done:
            tensor, scheme = self.graph.weights[weight.name], self.scheme_of(weight)
            q = round_weight(tensor.float(), scheme, self.importance.get(weight.name))
            self.done[weight.name] = self._add(weight.name, q)
            self.bytes_before += tensor.numel() * tensor.element_size()
            self.bytes_after += q.nbytes
        return self.done[weight.name]

    def _add(self, name: str, q: QuantizedWeight) -> tuple[Value, Value, Value | None]:
        g = self.graph
        zeros = None if q.zeros is None else g.add_param(g.fresh_name(f"{name}.zeros"), q.zeros)
        return (
            g.add_param(g.fresh_name(f"{name}.q{q.bits}"), q.qweight),
            g.add_param(g.fresh_name(f"{name}.scales"), q.scales),
            zeros,
        )

    def scheme_of(self, weight: Value) -> QuantScheme:
        return self.overrides.get(weight.name, self.scheme)

    def attrs(self, weight: Value) -> dict:
        scheme = self.scheme_of(weight)
        return {"bits": scheme.bits, "group_size": scheme.group_size_for(weight.type.shape[-1])}


def quantize_weights(
    graph: Graph,
    scheme: QuantScheme,
    include_embeddings: bool = False,
    overrides: dict[str, QuantScheme] | None = None,
    importance: dict[str, torch.Tensor] | None = None,
) -> Graph:
    """Rewrite `graph` in place (see the module docstring); returns it. `overrides` gives some
    weights (by name) another scheme than `scheme` (mixed precision); `importance`, per weight
    name, the fitted rounding's error weight of each input column (activation_importance.py)."""
    skipped = set() if include_embeddings else output_projections(graph) | embedding_tables(graph)
    quantizer = WeightQuantizer(graph, scheme, overrides, importance)
    replaced = 0
    for node in list(graph.nodes):
        replacement = None
        if (
            node.op == "linear"
            and node.inputs[1].name not in skipped
            and eligible_weight(graph, node.inputs[1], scheme)
        ):
            qweight, scales, zeros = quantizer.params_for(node.inputs[1])
            replacement = graph.create(
                "linear_q", [node.inputs[0], qweight, scales, zeros, node.inputs[2]], quantizer.attrs(node.inputs[1])
            )
        elif (
            node.op == "gathered_matmul"
            and node.inputs[0].type.dtype == "f32"  # gathered_matmul_q multiplies f32 rows only
            and eligible_weight(graph, node.inputs[0], scheme)
        ):
            qweight, scales, zeros = quantizer.params_for(node.inputs[0])
            replacement = graph.create(
                "gathered_matmul_q", [qweight, scales, *node.inputs[1:], zeros], quantizer.attrs(node.inputs[0])
            )
        elif node.op == "embedding" and include_embeddings and eligible_weight(graph, node.inputs[0], scheme):
            qweight, scales, zeros = quantizer.params_for(node.inputs[0])
            attrs = {**quantizer.attrs(node.inputs[0]), "dtype": node.inputs[0].type.dtype}
            replacement = graph.create("embedding_q", [qweight, scales, node.inputs[1], zeros], attrs)
        if replacement is None:
            continue
        graph.insert_before(node, replacement)
        graph.replace_all_uses(node.output, replacement.output)
        graph.erase(node)
        replaced += 1
    eliminate_dead_code(graph)  # drops the f32 weights nothing reads any more
    graph.meta["quantization"] = {
        "scheme": scheme.name,
        "quantized_nodes": replaced,
        "quantize_embeddings": include_embeddings,
        "weight_bytes_before": quantizer.bytes_before,
        "weight_bytes_after": quantizer.bytes_after,
    }
    return graph
