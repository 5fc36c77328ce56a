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

With `kv_layout="paged"` (ir/ops/paged_kv.py), each buffer is a pool [num_blocks, kv_heads,
block_size, last] instead, and a `block_table` i32 [batch, blocks_per_row] input (after the caches,
before the token-tree inputs) says which blocks hold each row's slots: `kv_write` writes through
it, and `attention` reads `kv_pages` of the written pool (the row's slots gathered in order).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Node, TensorType, Value
from kiln.ir.errors import KilnError

KV_CACHE_KINDS = ("f32", "int8")  # what the buffers hold: the model's dtype, or int8 codes with scales
KV_LAYOUTS = ("static", "paged")  # a row per request, or blocks of a shared pool (docs/kv-cache.md)


@dataclass(frozen=True)
class PagedLayout:
    """A paged cache's shape: `num_blocks` blocks of `block_size` slots per layer and buffer."""

    block_size: int
    num_blocks: int
    blocks_per_row: int


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
    foreign = _foreign_source(graph, mask)
    if foreign is None and (mask.type.dtype == "bool" or _additive_position_mask(graph, mask)):
        return  # a mask of the positions alone: the causal (or sliding) mask the cache applies itself
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


def paged_layout(max_batch: int, max_seq_len: int, block_size: int, num_blocks: int | None) -> PagedLayout:
    """The pool for `max_seq_len` slots a row in blocks of `block_size`; `num_blocks` None: as many
    as the static rows hold (max_batch full rows), plus the runtime's scratch block."""
    if block_size < 1 or (num_blocks is not None and num_blocks < 2):
        raise KVCacheInsertionError(
            f"a paged cache needs block_size >= 1 and num_blocks >= 2, got {block_size}, {num_blocks}"
        )
    per_row = -(-max_seq_len // block_size)
    return PagedLayout(block_size, num_blocks or max_batch * per_row + 1, per_row)


def insert_kv_cache(
    graph: Graph,
    max_batch: int,
    max_seq_len: int,
    token_trees: bool = False,
    kv_cache: str = "f32",
    paged: PagedLayout | None = None,
) -> Graph:
    """Rewrite `graph` in place to the stateful form (static rows, or `paged` blocks); returns it."""
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
    table = _block_table_input(graph, positions, paged) if paged else None
    new_caches: list[Value] = []
    for layer, node in enumerate(attentions):
        limits = (max_batch, max_seq_len, windows[layer])
        layout = (paged, table)
        new_caches += _make_stateful(graph, node, layer, (slots, tree), limits, kv_cache == "int8", layout)
    late = [v for v in (table, slots if token_trees else None, tree) if v is not None]
    # after the caches, the token-tree inputs last: the inputs before them keep their places
    graph.inputs = [v for v in graph.inputs if all(v is not x for x in late)] + late
    graph.outputs = graph.outputs[:1] + new_caches
    graph.meta["kv_cache"] = {"max_batch": max_batch, "max_seq_len": max_seq_len, "layers": len(attentions)}
    if kv_cache != "f32":  # an artifact without the key holds f32 buffers
        graph.meta["kv_cache"]["kind"] = kv_cache
    if paged:  # an artifact without the key holds static rows
        graph.meta["kv_cache"]["layout"] = "paged"
        graph.meta["kv_cache"].update(
            block_size=paged.block_size, num_blocks=paged.num_blocks, blocks_per_row=paged.blocks_per_row
        )
    return graph


def _block_table_input(graph: Graph, positions: Value, paged: PagedLayout) -> Value:
    batch = positions.type.shape[0]
    return graph.add_input("block_table", TensorType("i32", (batch, paged.blocks_per_row)))


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
    layout: tuple[PagedLayout | None, Value | None],
) -> list[Value]:
    slots, tree = placement
    max_batch, max_seq_len, window = limits
    paged, table = layout
    _check_mask(graph, node, layer)
    q, k, v = node.inputs[:3]
    k, v = grouped_source(k), grouped_source(v)
    created, sources = [], {"k": k, "v": v}
    if int8:  # codes into cache.k / cache.v, one scale per token and head beside them
        for kind, new in (("k", k), ("v", v)):
            created.append(graph.create("kv_quantize", [new]))
            sources[kind], sources[f"{kind}_scale"] = created[-1].outputs
    caches = []
    rows, slots_per_row = (paged.num_blocks, paged.block_size) if paged else (max_batch, max_seq_len)
    for kind, new in sources.items():
        _, kv_heads, _, last = new.type.shape
        cache_type = TensorType(new.type.dtype, (rows, kv_heads, slots_per_row, last))
        caches.append(graph.add_input(f"cache.{kind}.{layer}", cache_type))
    through = [table] if paged else []
    written = [graph.create("kv_write", [c, new, slots, *through]) for c, new in zip(caches, sources.values())]
    read = [graph.create("kv_pages", [w.output, table]) for w in written] if paged else written
    scales = [r.output for r in read[2:]]
    attrs = dict(node.attrs, causal=False, window=window)
    attention = graph.create("attention", [q, read[0].output, read[1].output, None, slots, tree, *scales], attrs)
    graph.insert_before(node, *created, *written, *(read if paged else []), attention)
    graph.replace_all_uses(node.output, attention.output)
    graph.erase(node)
    return [w.output for w in written]
