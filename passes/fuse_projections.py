"""fuse_projections: linears that read the same input -> one `linear` and `slice`s of its output.

    q = linear(x, Wq, bq); k = linear(x, Wk, bk); v = linear(x, Wv, bv)
 -> qkv = linear(x, cat(Wq, Wk, Wv), cat(bq, bk, bv)); q, k, v = slices of qkv's last axis
The same merges gate/up in a SwiGLU MLP. One matrix product instead of three reads x once
and gives the kernel a wider output to work on (decode is a GEMV per linear).
Merged only when every weight (and bias) is a parameter read by that linear alone: a weight
shared with another op (tied embeddings) would otherwise be stored twice. The group's biases
must be all present or all absent. The merged parameter is named after its parts, e.g.
`model.layers.0.self_attn.q_proj-k_proj-v_proj.weight`.
"""

from __future__ import annotations

import os

import torch

from kiln.ir import Graph, Node, Value

from .dce import eliminate_dead_code


def _own_param(value: Value | None, graph: Graph) -> bool:
    return value is not None and value.name in graph.params and len(value.users) == 1


def _mergeable(node: Node, graph: Graph) -> bool:
    weight, bias = node.inputs[1], node.inputs[2]
    return (
        _own_param(weight, graph)
        and weight.name in graph.weights
        and (bias is None or (_own_param(bias, graph) and bias.name in graph.weights))
    )


def merged_name(names: list[str]) -> str:
    """`a.q_proj.weight`, `a.k_proj.weight` -> `a.q_proj-k_proj.weight`."""
    prefix = os.path.commonprefix(names)
    prefix = prefix[: prefix.rfind(".") + 1]
    suffix = os.path.commonprefix([n[::-1] for n in names])[::-1]
    suffix = suffix[suffix.find(".") :] if "." in suffix else ""
    middles = [n[len(prefix) : len(n) - len(suffix)] for n in names]
    return prefix + "-".join(middles) + suffix


def _merged_param(graph: Graph, values: list[Value]) -> Value:
    tensor = torch.cat([graph.weights[v.name] for v in values], dim=0)
    return graph.add_param(graph.fresh_name(merged_name([v.name for v in values])), tensor)


def _groups(graph: Graph) -> list[list[Node]]:
    """Mergeable linears by shared input, in graph order, for inputs read by two or more."""
    by_input: dict[int, list[Node]] = {}
    for node in graph.nodes:
        if node.op == "linear" and _mergeable(node, graph):
            by_input.setdefault(id(node.inputs[0]), []).append(node)
    groups = []
    for nodes in by_input.values():
        has_bias = {n.inputs[2] is not None for n in nodes}
        dtypes = {n.inputs[1].type.dtype for n in nodes}
        if len(nodes) >= 2 and len(has_bias) == 1 and len(dtypes) == 1:
            groups.append(nodes)
    return groups


def _merge(graph: Graph, linears: list[Node]) -> None:
    weight = _merged_param(graph, [n.inputs[1] for n in linears])
    bias = _merged_param(graph, [n.inputs[2] for n in linears]) if linears[0].inputs[2] is not None else None
    merged = graph.create("linear", [linears[0].inputs[0], weight, bias])
    new_nodes, start = [merged], 0
    for node in linears:
        end = start + node.inputs[1].type.shape[0]
        part = graph.create("slice", [merged.output], {"axis": -1, "start": start, "end": end})
        new_nodes.append(part)
        start = end
    graph.insert_before(linears[0], *new_nodes)
    for node, part in zip(linears, new_nodes[1:]):
        graph.replace_all_uses(node.output, part.output)


def fuse_projections(graph: Graph) -> Graph:
    """Merge each group of linears sharing an input, in place; dead nodes and weights are removed."""
    for linears in _groups(graph):
        _merge(graph, linears)
    return eliminate_dead_code(graph)
