"""insert_kv_cache: turn the stateless forward into the stateful one with static KV buffers.

Before: (tokens, positions) -> logits, where each layer's `attention(q, k, v, mask)` sees the
keys of the current call only, under a mask the model built from positions.
After:  (tokens, positions, cache.k.0, cache.v.0, ...) -> (logits, cache.k.0', cache.v.0', ...)
with one buffer pair per layer, [max_batch, kv_heads, max_seq_len, head_dim]. Each attention
becomes `kv_write` of its grouped k/v into the buffers at `positions`, then `attention` over the
whole buffer under the position mask (sliding windows from the model's metadata). The model's
own mask-building ops and GQA head repetition become dead and are removed by DCE. One graph
serves prefill and decode at every position: positions are data, not shapes. A float mask that is
more than an additive causal mask of the positions (a learned or data-dependent bias) would be
lost that way: it is refused with `UnsupportedMaskError`, naming the model's source line.

With `token_trees`, two inputs follow the caches: `slots` [batch, seq] (the cache slots the call's
tokens are written to and attend from, where `positions` stay the tokens' positions in their
sequence, which RoPE reads) and `tree` bool [batch, seq, seq] (which of the call's own tokens each
one sees: its ancestors and itself). A token tree is then verified in one step: siblings share a
position but not a slot. A plain call passes slots = positions and a lower-triangular tree.

With `kv_cache="int8"`, each layer's k and v pass through `kv_quantize` (ir/ops/kv_quant.py)
before their writes: four buffers per layer, `cache.k.L` / `cache.v.L` holding i8 codes and
`cache.k_scale.L` / `cache.v_scale.L` f32 [max_batch, kv_heads, max_seq_len, 1] holding one scale
per token and head, all written by `kv_write` and read by `attention` as its k_scales / v_scales.
"""

from __future__ import annotations

from kiln.ir import Graph, Node, TensorType, Value
from kiln.ir.errors import KilnError

KV_CACHE_KINDS = ("f32", "int8")  # what the buffers hold: the model's dtype, or int8 codes with scales


class KVCacheInsertionError(KilnError, ValueError):
    """The graph does not have the shape this pass expects (a stateless causal LM forward)."""


class UnsupportedMaskError(KVCacheInsertionError):
    """An attention mask this pass cannot replace by the cache's position mask."""


SHAPE_OPS = ("reshape", "expand", "slice", "permute", "cast")


def _scalar(graph: Graph, value: Value) -> float | None:
    """The number a one-element constant holds (a `full`, or a folded parameter), else None."""
    node = value.producer
    while node is not None and node.op in SHAPE_OPS:
        value, node = node.inputs[0], node.inputs[0].producer
    if node is not None and node.op == "full":
        return float(node.attrs["value"])
    tensor = graph.weights.get(value.name) if value.name in graph.params else None
    return float(tensor.reshape(-1)[0]) if tensor is not None and tensor.numel() == 1 else None


def _foreign_source(graph: Graph, mask: Value) -> Value | None:
    """A value the mask is computed from other than `positions` and constants (a parameter that
    is not a scalar, the tokens, another graph input), else None."""
    stack, seen = [mask], set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.producer is not None:
            stack.extend(i for i in value.producer.inputs if i is not None)
        elif value.name != "positions" and _scalar(graph, value) is None:
            return value
    return None


def _additive_position_mask(graph: Graph, mask: Value) -> bool:
    """Whether a float mask is `where(a position mask, 0, -inf or a very negative number)` (either
    way round, through shape ops): the causal mask the cache's position mask stands for."""
    node = mask.producer
    while node is not None and node.op in SHAPE_OPS and node.inputs[0].type.dtype == mask.type.dtype:
        node = node.inputs[0].producer
    if node is None or node.op != "where" or node.inputs[0].type.dtype != "bool":
        return False
    values = {_scalar(graph, node.inputs[1]), _scalar(graph, node.inputs[2])}
    return None not in values and 0.0 in values and min(values) <= -1e4


def _check_mask(graph: Graph, node: Node, layer: int) -> None:
    """The cache replaces each attention's mask by its position mask: a mask that is more than a
    causal (or sliding-window) mask of the positions would be dropped, so it is an error."""
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    if mask is None:
        return
    if mask.type.dtype == "bool":
        return  # a boolean mask only hides keys: the models' masks are causal ones of the positions
    foreign = _foreign_source(graph, mask)
    if foreign is None and _additive_position_mask(graph, mask):
        return
    made_by = f"`{mask.producer.op}`" if mask.producer is not None else "a graph input"
    line = graph.source_lines.get(mask) or "an unknown source line"
    reads = f", computed from %{foreign.name} {foreign.type}" if foreign is not None else ""
    raise UnsupportedMaskError(
        f"attention of layer {layer} takes a {mask.type.dtype} mask %{mask.name} made by {made_by} at {line}{reads}, "
        "which is not a causal mask of the positions: the static KV cache would replace it by its own "
        "position mask and drop what it adds. Fix: rewrite that line so the mask depends on the positions "
        "alone (Kiln applies causal and sliding-window masking itself), or express the bias as an "
        "attribute `attention` takes (ALiBi slopes, logit soft-capping)."
    )


def grouped_source(value: Value) -> Value:
    """Undo GQA's repeat_kv (reshape <- expand <- reshape of [b, kv, t, d]) to keep heads grouped."""
    node = value.producer
    if node is None or node.op != "reshape":
        return value
    expand = node.inputs[0].producer
    if expand is None or expand.op != "expand":
        return value
    unsqueeze = expand.inputs[0].producer
    if unsqueeze is None or unsqueeze.op != "reshape" or unsqueeze.inputs[0].type.rank != 4:
        return value
    grouped = unsqueeze.inputs[0]
    b, kv_heads, t, d = grouped.type.shape
    if unsqueeze.output.type.shape != (b, kv_heads, 1, t, d):
        return value
    return grouped


def insert_kv_cache(
    graph: Graph, max_batch: int, max_seq_len: int, token_trees: bool = False, kv_cache: str = "f32"
) -> Graph:
    """Rewrite `graph` in place to the stateful form; returns it."""
    if kv_cache not in KV_CACHE_KINDS:
        raise KVCacheInsertionError(f"kv_cache {kv_cache!r} is not one of {list(KV_CACHE_KINDS)}")
    if [v.name for v in graph.inputs] != ["tokens", "positions"]:
        raise KVCacheInsertionError("expected a stateless graph with inputs (tokens, positions)")
    positions = graph.inputs[1]
    attentions = [n for n in graph.nodes if n.op == "attention"]
    if not attentions:
        raise KVCacheInsertionError("the graph has no attention op: is it a causal LM?")
    windows = graph.meta.get("model", {}).get("layer_windows") or [0] * len(attentions)
    if len(windows) != len(attentions):
        raise KVCacheInsertionError(f"{len(attentions)} attention ops but {len(windows)} layers in the metadata")
    slots, tree = _tree_inputs(graph, positions) if token_trees else (positions, None)
    new_caches: list[Value] = []
    for layer, node in enumerate(attentions):
        limits = (max_batch, max_seq_len, windows[layer])
        new_caches += _make_stateful(graph, node, layer, (slots, tree), limits, kv_cache == "int8")
    if token_trees:  # after the caches: the inputs before them keep their places
        graph.inputs = [v for v in graph.inputs if v is not slots and v is not tree] + [slots, tree]
    graph.outputs = graph.outputs[:1] + new_caches
    graph.meta["kv_cache"] = {"max_batch": max_batch, "max_seq_len": max_seq_len, "layers": len(attentions)}
    if kv_cache != "f32":  # an artifact without the key holds f32 buffers
        graph.meta["kv_cache"]["kind"] = kv_cache
    return graph


def _tree_inputs(graph: Graph, positions: Value) -> tuple[Value, Value]:
    batch, seq = positions.type.shape
    slots = graph.add_input("slots", TensorType("i64", (batch, seq)))
    return slots, graph.add_input("tree", TensorType("bool", (batch, seq, seq)))


def _make_stateful(
    graph: Graph,
    node: Node,
    layer: int,
    placement: tuple[Value, Value | None],
    limits: tuple[int, int, int],
    int8: bool,
) -> list[Value]:
    slots, tree = placement
    max_batch, max_seq_len, window = limits
    _check_mask(graph, node, layer)
    q, k, v = node.inputs[:3]
    k, v = grouped_source(k), grouped_source(v)
    created, sources = [], {"k": k, "v": v}
    if int8:  # codes into cache.k / cache.v, one scale per token and head beside them
        for kind, new in (("k", k), ("v", v)):
            created.append(graph.create("kv_quantize", [new]))
            sources[kind], sources[f"{kind}_scale"] = created[-1].outputs
    caches = []
    for kind, new in sources.items():
        _, kv_heads, _, last = new.type.shape
        cache_type = TensorType(new.type.dtype, (max_batch, kv_heads, max_seq_len, last))
        caches.append(graph.add_input(f"cache.{kind}.{layer}", cache_type))
    written = [graph.create("kv_write", [cache, new, slots]) for cache, new in zip(caches, sources.values())]
    scales = [w.output for w in written[2:]]
    attrs = dict(node.attrs, causal=False, window=window)
    attention = graph.create("attention", [q, written[0].output, written[1].output, None, slots, tree, *scales], attrs)
    graph.insert_before(node, *created, *written, attention)
    graph.replace_all_uses(node.output, attention.output)
    graph.erase(node)
    return [w.output for w in written]
