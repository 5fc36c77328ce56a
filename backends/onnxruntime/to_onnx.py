"""The lowering driver: a stateful Kiln IR graph -> an ONNX model (`OnnxProgram`).

The model's signature follows the IR's:

    inputs:  tokens i64[batch, seq], positions i64[batch, seq], cache.k.0, cache.v.0, ...
             each cache [batch, kv_heads, max_seq_len, head_dim] (the first `batch` rows of a buffer),
             (a paged cache: each pool [num_blocks, kv_heads, block_size, head_dim] whole, then
             block_table i32[batch, blocks_per_row]),
             then slots i64[batch, seq], tree bool[batch, seq, seq] where the graph takes token trees
    outputs: logits [batch, seq, vocab], present.k.0, present.v.0, ... (the updated caches)

Nodes are lowered in IR order, each by its entry in `ONNX_LOWERINGS`, except the groups
`contrib_patterns.plan_contrib_ops` hands to ORT's fused kernels. Then names are resolved, nodes
that nothing reads are pruned, the rest sorted topologically, and `program.info` says how the
executable binds the caches: in place (GroupQueryAttention updates the buffer it reads; so does a
plain ScatterND whose output is bound to its data input's buffer: ORT skips the copy when the
two are one buffer) or copied back (a cache something else also reads).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from kiln.backends.executable import cache_inputs
from kiln.backends.paged_feeds import paged_layout
from kiln.backends.token_trees import TREE_INPUTS, has_token_trees, verifies_trees
from kiln.ir import Graph, Node, ops_with

from .contrib_patterns import SEQLENS_K, TOTAL_LENGTH, Plan, plan_contrib_ops
from .errors import OnnxLoweringError, UnsupportedOpError
from .onnx_builder import MS_DOMAIN, OnnxBuilder, elem_type, layer_scopes, node_label, onnx_dims
from .op_lowerings import ONNX_LOWERINGS, check_lowering_table
from .paged_attention import BLOCK_TABLE
from .providers import attention_dtypes

OPSET = 23  # RMSNormalization is standard ONNX from opset 23
IR_VERSION = 10
INFO_KEY = "kiln.program"
# The sequence positions whose logits the model computes (i64 [k]): every position, or only the
# last for a prompt whose next token is all that is wanted (the lm_head of a 49k vocabulary is a
# fifth of a 512-token prefill's work).
LOGIT_POSITIONS = "logit_positions"


@dataclass
class OnnxProgram:
    """An ONNX model without its weights (kept apart as arrays) and how to run it."""

    model: onnx.ModelProto
    initializers: dict[str, np.ndarray]
    info: dict  # {"caches": [{"input", "output", "in_place"}], "contiguous_positions": bool, ...}

    def op_types(self) -> list[str]:
        return [n.op_type for n in self.model.graph.node]


def present_name(cache_name: str) -> str:
    """`cache.k.3` -> `present.k.3`, the output that carries the updated buffer."""
    return "present." + cache_name.removeprefix("cache.")


def graph_to_onnx(
    graph: Graph, weights=None, contrib_ops: bool = True, provider: str = "CPUExecutionProvider"
) -> OnnxProgram:
    """Lower a stateful graph (weights from `weights` or `graph.weights`) to ONNX for `provider`
    (whose kernels decide which attention dtypes go to GroupQueryAttention)."""
    check_lowering_table()
    b = OnnxBuilder(graph, graph.weights if weights is None else weights)
    inputs = _declare_inputs(graph, b)
    plan = plan_contrib_ops(graph, attention_dtypes(provider)) if contrib_ops else Plan()
    head = logits_head(graph)
    _lower_nodes(graph, b, plan, head)
    outputs = _name_outputs(graph, b, selected=head is not None)
    nodes = _resolve_and_prune(b.nodes, b.renames, [o.name for o in outputs])
    used = {name for n in nodes for name in n.input}
    initializers = {k: v for k, v in b.initializers.items() if k in used}
    value_infos = [vi for vi in b.value_infos if vi.name in {o for n in nodes for o in n.output}]
    graph_proto = helper.make_graph(
        nodes, "kiln", [i for i in inputs if i.name in used], outputs, value_info=value_infos
    )
    opsets = [helper.make_opsetid("", OPSET)] + [helper.make_opsetid(MS_DOMAIN, 1)] * (MS_DOMAIN in b.opsets)
    model = helper.make_model(graph_proto, opset_imports=opsets, producer_name="kiln", ir_version=IR_VERSION)
    info = _program_info(graph, plan, used, nodes)
    return OnnxProgram(model, initializers, info)


def _declare_inputs(graph: Graph, b: OnnxBuilder) -> list[onnx.ValueInfoProto]:
    tokens = graph.inputs[0]
    batch = tokens.type.shape[0]
    inputs = []
    for v in graph.inputs[:2]:
        b.define(v, v.name)
        b.bind_symbols(v.name, v.type.shape)
        inputs.append(helper.make_tensor_value_info(v.name, elem_type(v.type.dtype), onnx_dims(v.type.shape)))
    inputs.append(helper.make_tensor_value_info(LOGIT_POSITIONS, onnx.TensorProto.INT64, ["logit_count"]))
    inputs.append(helper.make_tensor_value_info(SEQLENS_K, onnx.TensorProto.INT32, onnx_dims((batch,))))
    inputs.append(helper.make_tensor_value_info(TOTAL_LENGTH, onnx.TensorProto.INT32, []))
    for v in cache_inputs(graph):
        b.define(v, v.name)  # a cache is fed as its first `batch` rows (a paged pool whole)
        inputs.append(helper.make_tensor_value_info(v.name, elem_type(v.type.dtype), onnx_dims(_fed_shape(graph, v))))
    for v in graph.inputs:
        if v.name == BLOCK_TABLE:
            b.define(v, v.name)
            inputs.append(helper.make_tensor_value_info(v.name, elem_type(v.type.dtype), onnx_dims(v.type.shape)))
    for v in graph.inputs[-2:] if has_token_trees(graph) else ():
        b.define(v, v.name)
        inputs.append(helper.make_tensor_value_info(v.name, elem_type(v.type.dtype), onnx_dims(v.type.shape)))
    return inputs


def _fed_shape(graph: Graph, cache) -> tuple:
    """A cache's shape as fed and returned: its first `batch` rows, or a paged pool whole."""
    if paged_layout(graph) is not None:
        return tuple(cache.type.shape)
    return (graph.inputs[0].type.shape[0], *cache.type.shape[1:])


def logits_head(graph: Graph) -> Node | None:
    """The linear that makes the logits (only elementwise ops with constants after it, as Gemma's
    softcap), when its input [batch, seq, hidden] feeds nothing else: the lowering gathers that
    input at LOGIT_POSITIONS, so the projection runs for those positions only."""
    value = graph.outputs[0]
    while value.producer is not None and value.producer.op in ops_with("elementwise"):
        node = value.producer
        if any(
            i is not None and i is not node.inputs[0] and i.type.rank > 0 and any(d != 1 for d in i.type.shape)
            for i in node.inputs[1:]
        ):
            return None
        value = node.inputs[0]
    node = value.producer
    if node is None or node.op not in ("linear", "linear_q") or node.inputs[0].type.rank != 3:
        return None
    return node if len(node.inputs[0].users) == 1 else None


def _lower_nodes(graph: Graph, b: OnnxBuilder, plan: Plan, head: Node | None = None) -> None:
    scopes = layer_scopes(graph)
    for node in graph.nodes:
        if id(node) in plan.skipped:  # produced by a group's kernel, under its IR name
            for v in node.outputs:
                b.define(v, v.name)
    for node in graph.nodes:
        if id(node) in plan.skipped:
            continue
        b.scope, b.label = scopes[id(node)], node_label(graph, node)
        if node is head:  # the hidden states of the selected positions only
            b.define(node.inputs[0], b.op("Gather", b.value(node.inputs[0]), LOGIT_POSITIONS, axis=1))
        lower = plan.emitters.get(id(node)) or (lambda b, node=node: _lower_one(b, node))
        names = lower(b)
        names = [names] if isinstance(names, str) else names
        for v, name in zip(node.outputs, names):
            b.define(v, name)


def _lower_one(b: OnnxBuilder, node) -> str | list[str]:
    if node.op not in ONNX_LOWERINGS:
        raise UnsupportedOpError(
            f"IR op {node.op!r} has no ONNX lowering; add it to ONNX_LOWERINGS in backends/onnxruntime/op_lowerings.py"
        )
    return ONNX_LOWERINGS[node.op](b, node)


def _name_outputs(graph: Graph, b: OnnxBuilder, selected: bool = False) -> list[onnx.ValueInfoProto]:
    """Graph outputs under fixed names: `logits` ([batch, logit_count, vocab] when `selected`),
    then `present.<cache>` per cache input."""
    logits_shape = graph.outputs[0].type.shape
    named = [
        ("logits", graph.outputs[0], (logits_shape[0], "logit_count", logits_shape[2]) if selected else logits_shape)
    ]
    for cache, out in zip(cache_inputs(graph), graph.outputs[1:]):
        named.append((present_name(cache.name), out, _fed_shape(graph, out)))
    outputs = []
    taken = {v.name for v in graph.inputs} | set(b.initializers)
    for name, value, shape in named:
        current = _resolve(b.value(value), b.renames)
        if current in taken or current in {o.name for o in outputs}:
            b.node("Identity", [current], [name])
        else:
            b.rename(current, name)
            for n in b.nodes:  # the producer writes the fixed name itself
                n.output[:] = [name if o == current else o for o in n.output]
        outputs.append(helper.make_tensor_value_info(name, elem_type(value.type.dtype), onnx_dims(shape)))
    return outputs


def _resolve(name: str, renames: dict[str, str]) -> str:
    seen = set()
    while name in renames and name not in seen:
        seen.add(name)
        name = renames[name]
    return name


def _resolve_and_prune(
    nodes: list[onnx.NodeProto], renames: dict[str, str], outputs: list[str]
) -> list[onnx.NodeProto]:
    """Apply renames, keep the nodes the outputs need, and order them topologically (stable)."""
    for n in nodes:
        n.input[:] = [_resolve(i, renames) for i in n.input]
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    needed, stack = set(), [producer[o] for o in outputs if o in producer]
    while stack:
        i = stack.pop()
        if i not in needed:
            needed.add(i)
            stack.extend(producer[x] for x in nodes[i].input if x in producer)
    waiting = {i: {producer[x] for x in nodes[i].input if x in producer} for i in needed}
    readers: dict[int, list[int]] = {}
    for i, deps in waiting.items():
        for d in deps:
            readers.setdefault(d, []).append(i)
    ready = [i for i, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers.get(i, []):
            waiting[r].discard(i)
            if not waiting[r]:
                heapq.heappush(ready, r)
    if len(order) != len(needed):
        raise OnnxLoweringError("the lowered ONNX graph has a cycle; this is a bug in the onnxruntime backend")
    return [nodes[i] for i in order]


def _program_info(graph: Graph, plan: Plan, used: set[str], nodes: list[onnx.NodeProto]) -> dict:
    scattered = _scattered_in_place(nodes)
    caches = [
        {
            "input": c.name,
            "output": present_name(c.name),
            "in_place": c.name in plan.in_place_caches or c.name in scattered,
            "shape": [int(d) for d in c.type.shape],
            "dtype": c.type.dtype,
        }
        for c in cache_inputs(graph)
    ]
    return {
        "format": 1,
        # fed by the executable: tokens, positions, GroupQueryAttention's lengths (from the slots),
        # and a token tree's slots and visibility
        "inputs": [
            name
            for name in (graph.inputs[0].name, graph.inputs[1].name, LOGIT_POSITIONS, SEQLENS_K, TOTAL_LENGTH)
            + (BLOCK_TABLE,)
            + TREE_INPUTS
            if name in used
        ],
        "token_trees": has_token_trees(graph),
        "verifies_trees": verifies_trees(graph),  # the engine verifies drafts as trees
        "caches": caches,
        "logits": "logits",
        "vocab": graph.outputs[0].type.shape[-1],
        "logits_dtype": graph.outputs[0].type.dtype,
        # GroupQueryAttention derives each token's slot from the row's last one
        "contiguous_positions": bool(plan.in_place_caches),
        # it rotates by position_ids (a token tree's depths), except in a first prompt
        # a paged pool's layout (block_size, num_blocks, blocks_per_row): fed a block table
        "paged": paged_layout(graph),
        "position_ids": any(n.op_type == "GroupQueryAttention" and len(n.input) > 9 and n.input[9] for n in nodes),
    }


def _scattered_in_place(nodes: list[onnx.NodeProto]) -> set[str]:
    """Caches whose present.* is a ScatterND of the cache itself and nothing else reads the cache:
    binding both to one buffer updates it in place (the kernel copies data to output only when
    they differ), so no copy of the cache per step, on any device."""
    readers: dict[str, int] = {}
    for node in nodes:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    return {
        node.input[0]
        for node in nodes
        if node.op_type == "ScatterND"
        and node.input[0].startswith("cache.")
        and node.output[0] == present_name(node.input[0])
        and readers[node.input[0]] == 1
    }
