"""`attention` and `kv_write` in plain ONNX ops: the fallback where GroupQueryAttention does not fit.

`contrib_patterns.py` lowers an attention over two kv_writes to one GroupQueryAttention that
updates the cache in place; these forms serve every other case (a float mask, ALiBi, a head size
that is not a multiple of 8, contrib ops switched off). They follow the IR's reference kernels in
`kiln.ir.ops.attention`: GQA stays grouped (q reshaped to [b, kv_heads, groups, s, d] against
k unsqueezed to [b, kv_heads, 1, keys, d]), keys are masked by positions (key slot <= query
position, within the window), and a row that sees no key attends to nothing. kv_write is a
ScatterND, which returns a new cache: the executable copies it back into its buffer, or binds it
to the cache's own buffer where nothing else reads the cache (an update in place). A paged pool's
kv_write and kv_pages are paged_attention.py's; attention reads kv_pages' rows like a static row.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.ir import Node
from kiln.ir.dims import dims_equal

from . import paged_attention
from .errors import OnnxLoweringError
from .onnx_builder import NUMPY_DTYPES, OnnxBuilder, shared_scope


def lower_kv_write(b: OnnxBuilder, node: Node) -> str:
    """cache[r, h, positions[r, t]] = new[r, h, t] as ScatterND with [rows, heads, positions] indices."""
    cache, new, positions, table = node.inputs[:4]
    if table is not None:  # a paged pool
        return paged_attention.lower_paged_kv_write(b, node)
    heads = new.type.shape[1]
    if not isinstance(heads, int):
        raise OnnxLoweringError(f"kv_write needs a static number of heads, got {new.type}")
    updates = b.typed(new, cache.type.dtype)
    grid = b.op("Shape", updates, start=0, end=3)  # [rows, heads, tokens]
    rows = b.op("Range", b.const(0), b.op("Squeeze", b.op("Shape", updates, start=0, end=1), b.const([0])), b.const(1))
    columns = [
        b.op("Reshape", rows, b.const([-1, 1, 1])),
        b.const(np.arange(heads).reshape(1, heads, 1)),
        b.op("Unsqueeze", b.typed(positions, "i64"), b.const([1])),
    ]
    columns = [b.op("Unsqueeze", b.op("Expand", c, grid), b.const([-1])) for c in columns]
    return b.op("ScatterND", b.value(cache), b.op("Concat", *columns, axis=-1), updates)


def lower_attention(b: OnnxBuilder, node: Node) -> str:
    q, k, v, mask, positions, tree = node.inputs[:6]  # an int8 cache's scales: kv_quantize refused it first
    attrs = node.attrs
    q_heads, kv_heads, head_dim = q.type.shape[1], k.type.shape[1], q.type.shape[3]
    if not all(isinstance(d, int) for d in (q_heads, kv_heads, head_dim, v.type.shape[3])):
        raise OnnxLoweringError(f"attention needs static head counts and sizes, got q {q.type}, k {k.type}")
    groups = q_heads // kv_heads
    keys, values = _leading_rows(b, k, q), _leading_rows(b, v, q)
    queries = b.value(q)
    if groups > 1:  # [b, kv, g, s, d] against [b, kv, 1, keys, d]
        queries = b.op("Reshape", queries, b.const([0, kv_heads, groups, -1, head_dim]))
        keys, values = (b.op("Unsqueeze", t, b.const([2])) for t in (keys, values))
    rank = 5 if groups > 1 else 4
    key_axes = list(range(rank - 2)) + [rank - 1, rank - 2]
    scores = b.op("MatMul", queries, b.op("Transpose", keys, perm=key_axes))
    dtype = NUMPY_DTYPES[q.type.dtype]
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(head_dim)
    scores = b.op("Mul", scores, b.const(scale, dtype))
    if attrs["softcap"]:
        cap = b.const(attrs["softcap"], dtype)
        scores = b.op("Mul", b.op("Tanh", b.op("Div", scores, cap)), cap)
    if attrs["alibi"]:
        scores = b.op("Add", scores, _alibi_bias(b, q, k, positions, attrs["alibi"], rank, kv_heads))
    visible = _visible_keys(b, q, k, positions, attrs, rank)
    if tree is not None:
        seen = tree_visible_keys(b, positions, tree, _key_count(b, k))
        seen = b.op("Unsqueeze", seen, b.const(list(range(1, rank - 2))))
        visible = b.op("And", visible, seen)
    if mask is not None:
        grouped_mask = _grouped(b, mask, groups, kv_heads)
        if mask.type.dtype == "bool":
            visible = grouped_mask if visible is None else b.op("And", visible, grouped_mask)
        else:
            scores = b.op("Add", scores, b.cast(grouped_mask, mask.type.dtype, q.type.dtype))
    if visible is not None:
        scores = b.op("Where", visible, scores, b.const(-np.inf, dtype))
    probs = b.op("Softmax", scores, axis=-1)
    if mask is not None or paged_attention.key_count(b, k) is None:  # a paged row sees its own new slot
        probs = b.op("Where", b.op("IsNaN", probs), b.const(0.0, dtype), probs)  # a row that sees nothing
    out = b.op("MatMul", probs, values)
    if groups > 1:
        out = b.op("Reshape", out, b.const([0, q_heads, -1, v.type.shape[3]]))
    return out


def _leading_rows(b: OnnxBuilder, cache, q) -> str:
    """The first `batch` rows of a k/v whose batch may be larger than q's (a static cache)."""
    if dims_equal(cache.type.shape[0], q.type.shape[0]):
        return b.value(cache)
    batch = b.op("Shape", b.value(q), start=0, end=1)
    return b.op("Slice", b.value(cache), b.const([0]), batch, b.const([0]))


def _key_count(b: OnnxBuilder, k) -> str:
    """The key slots attended: a paged row's gathered blocks (known at run time), else k's dim."""
    return paged_attention.key_count(b, k) or b.scalar_dim(k.type.shape[2])


def _key_slots(b: OnnxBuilder, k) -> str:
    return b.op("Range", b.const(0), _key_count(b, k), b.const(1))


def _query_positions(b: OnnxBuilder, q, k, positions, rank: int) -> str:
    """i64 [b|1, 1, (1,) s, 1] (or [s, 1]): positions, else the last query at the last key."""
    if positions is not None:
        return b.op("Unsqueeze", b.typed(positions, "i64"), b.const(list(range(1, rank - 2)) + [rank - 1]))
    keys, seq = k.type.shape[2], q.type.shape[2]
    start = b.op("Sub", b.scalar_dim(keys), b.scalar_dim(seq))
    return b.op("Unsqueeze", b.op("Range", start, b.scalar_dim(keys), b.const(1)), b.const([1]))


def _alibi_bias(b: OnnxBuilder, q, k, positions, slopes, rank: int, kv_heads: int) -> str:
    """slope[h] * (key slot - query position), in the scores' (grouped) layout."""
    distance = b.op("Sub", _key_slots(b, k), _query_positions(b, q, k, positions, rank))
    layout = [1, len(slopes), 1, 1] if rank == 4 else [1, kv_heads, len(slopes) // kv_heads, 1, 1]
    heads = np.asarray(slopes, dtype=NUMPY_DTYPES[q.type.dtype]).reshape(layout)
    return b.op("Mul", b.const(heads, heads.dtype), b.cast(distance, "i64", q.type.dtype))


def _visible_keys(b: OnnxBuilder, q, k, positions, attrs, rank: int) -> str | None:
    """Bool [b|1, 1, (1,) s, keys]: key slot <= query position (and within the window)."""
    if positions is None and not attrs["causal"]:
        return None
    count = _key_count(b, k)
    queries = b.value(positions) if positions is not None else q.type.shape[2]
    key = f"visible/{queries}/{count}/{attrs['window']}/{rank}"
    if key in b.memo:  # every layer of a window kind sees the same keys
        return b.memo[key]
    slots = b.op("Range", b.const(0), count, b.const(1))
    query_pos = _query_positions(b, q, k, positions, rank)
    visible = b.op("LessOrEqual", slots, query_pos)
    if attrs["window"]:
        visible = b.op("And", visible, b.op("Greater", slots, b.op("Sub", query_pos, b.const(attrs["window"]))))
    b.memo[key] = visible
    return visible


def tree_visible_keys(b: OnnxBuilder, slots, tree, keys: str) -> str:
    """Bool [b, s, keys] (`keys` an i64 scalar): False where a key slot holds a token of this call
    that `tree` hides (`tree_visibility` of kiln.ir.ops.attention). Built once per graph and key
    count: every layer reads the same."""
    key = f"tree_visible/{b.value(slots)}/{b.value(tree)}/{keys}"
    if key in b.memo:
        return b.memo[key]
    with shared_scope(b, "/model/tree"):
        key_slots = b.op("Range", b.const(0), keys, b.const(1))
        first = b.op("Slice", b.typed(slots, "i64"), b.const([0]), b.const([1]), b.const([1]))  # [b, 1]
        own = b.op("Sub", key_slots, b.op("Unsqueeze", first, b.const([2])))  # [b, 1, keys]: the call's index j
        count = b.op("Shape", b.value(tree), start=2, end=3)
        inside = b.op("And", b.op("GreaterOrEqual", own, b.const(0)), b.op("Less", own, count))
        clamped = b.op("Min", b.op("Max", own, b.const(0)), b.op("Sub", count, b.const([1])))
        rows = b.op("Shape", b.value(tree), start=0, end=2)  # [b, s]
        columns = b.op("Expand", clamped, b.op("Concat", rows, b.op("Shape", clamped, start=2), axis=0))
        seen = b.op("GatherElements", b.value(tree), columns, axis=2)
        b.memo[key] = b.op("Or", b.op("Not", inside), seen)
    return b.memo[key]


def _grouped(b: OnnxBuilder, mask, groups: int, kv_heads: int) -> str:
    """A [b|1, heads|1, s, keys] mask in the grouped [b, kv, g, s, keys] layout."""
    if groups == 1:
        return b.value(mask)
    if mask.type.shape[1] == 1:
        return b.op("Unsqueeze", b.value(mask), b.const([2]))
    return b.op("Reshape", b.value(mask), b.shape([mask.type.shape[0], kv_heads, groups, *mask.type.shape[2:]]))
