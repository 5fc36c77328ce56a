"""The IR's text form: one line per input, parameter and node, types inline.

    kir 1
    sym batch in [1, 8]
    input %tokens: i64[batch, seq]
    param %model.embed_tokens.weight: f32[512, 64]
    %0: f32[batch, seq, 64] = embedding(%model.embed_tokens.weight, %tokens)
    %9: f32[batch, 4, seq, 16] = attention(%5, %7, %8, _, %positions) {scale=0.25, causal=false}
    output %logits

`parser.parse_graph` reads it back to a graph that prints identically.
"""

from __future__ import annotations

import json
import math

from .dims import format_dim, is_dim
from .graph import Graph, Node

FORMAT_VERSION = 1


def format_attr(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return repr(v)
        text = repr(v)
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(format_attr(x) for x in v) + "]"
    if is_dim(v):
        return format_dim(v)
    raise TypeError(f"attribute value {v!r} of type {type(v).__name__} has no text form")


def format_node(node: Node) -> str:
    outs = ", ".join(f"%{v.name}: {v.type}" for v in node.outputs)
    args = ", ".join("_" if v is None else f"%{v.name}" for v in node.inputs)
    text = f"{outs} = {node.op}({args})"
    if node.attrs:
        text += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in node.attrs.items()) + "}"
    return text


def print_graph(graph: Graph) -> str:
    lines = [f"kir {FORMAT_VERSION}"]
    lines += [f"sym {s.name} in [{s.min}, {s.max}]" for s in graph.symbols.values()]
    if graph.meta:
        lines.append("meta " + json.dumps(graph.meta, sort_keys=True))
    lines += [f"input %{v.name}: {v.type}" for v in graph.inputs]
    lines += [f"param %{v.name}: {v.type}" for v in graph.params.values()]
    lines += [format_node(n) for n in graph.nodes]
    lines.append("output " + ", ".join(f"%{v.name}" for v in graph.outputs))
    return "\n".join(lines) + "\n"
