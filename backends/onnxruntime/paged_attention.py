"""A paged KV cache (kiln/ir/ops/paged_kv.py) in standard ONNX ops: Kiln's own lowering.

ORT's com.microsoft PagedAttention runs on CUDA only, so the pools are addressed here with plain
ops, and the attention after them is plain_attention's:
- `kv_write` with a block table is a ScatterND of each new key into (block, head, offset) of the
  pool, the block looked up in the row's table at slot // block_size. Its output is bound to the
  pool's own buffer (to_onnx's `_scattered_in_place`): the write happens in place, no copy.
- `kv_pages` is one GatherND of (block, head) pairs: [batch, kv_heads, blocks, block_size, d] in
  the order attention reads, then a free reshape to [batch, kv_heads, blocks * block_size, d].
  Only the first ceil(total_sequence_length / block_size) blocks of each table are gathered (the
  largest slot of the call + 1, fed by the executable): no query of the call sees a later slot,
  so a decode step copies the blocks its rows hold, not max_seq_len slots a row.
The indices are built once per graph (every layer writes the same slots and reads the same table)
under /model/paged: a layer adds a ScatterND per pool and a GatherND per pool, no index arithmetic.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Node

from .errors import OnnxLoweringError
from .onnx_builder import OnnxBuilder, elem_type, shared_scope

TOTAL_LENGTH = "total_sequence_length"  # contrib_patterns' name: the largest slot of the call + 1
BLOCK_TABLE = "block_table"


def lower_paged_kv_write(b: OnnxBuilder, node: Node) -> str:
    """pool[table[r, s // size], h, s % size] = new[r, h, t] for s = slots[r, t]."""
    pool, new, slots, table = node.inputs[:4]
    heads, block_size = new.type.shape[1], pool.type.shape[2]
    if not isinstance(heads, int) or not isinstance(block_size, int):
        raise OnnxLoweringError(f"a paged kv_write needs static heads and block size, got {new.type}, {pool.type}")
    indices = _write_indices(b, slots, table, heads, block_size)
    return b.op("ScatterND", b.value(pool), indices, b.typed(new, pool.type.dtype))


def lower_kv_pages(b: OnnxBuilder, node: Node) -> str:
    """[batch, kv_heads, blocks * block_size, d]: the first blocks of each row's table, in order."""
    pool, table = node.inputs
    _, kv_heads, block_size, last = pool.type.shape
    if not all(isinstance(d, int) for d in (kv_heads, block_size, last)):
        raise OnnxLoweringError(f"kv_pages needs a pool of static shape, got {pool.type}")
    indices, slot_count = _page_indices(b, table, kv_heads, block_size)
    pages = b.op("GatherND", b.value(pool), indices)  # [batch, kv_heads, blocks, block_size, d]
    rows = b.op("Reshape", pages, b.const([0, 0, -1, last]))
    b.memo[f"key_count/{rows}"] = slot_count
    return rows


def key_count(b: OnnxBuilder, keys) -> str | None:
    """The run-time slot count (i64 scalar) of `keys` when they are kv_pages' gathered blocks."""
    return b.memo.get(f"key_count/{b.value(keys)}")


def _table(b: OnnxBuilder, table) -> str:
    key = "paged/table"
    if key not in b.memo:
        with shared_scope(b, "/model/paged"):
            b.memo[key] = b.typed(table, "i64")
    return b.memo[key]


def _write_indices(b: OnnxBuilder, slots, table, heads: int, block_size: int) -> str:
    """i64 [batch, heads, tokens, 3]: the (block, head, offset) each new key goes to."""
    key = f"paged/write/{b.value(slots)}/{heads}/{block_size}"
    if key not in b.memo:
        table_i64 = _table(b, table)
        with shared_scope(b, "/model/paged"):
            places = b.typed(slots, "i64")
            rows_and_tokens = b.op("Shape", places)
            grid = b.op(
                "Concat",
                b.op("Slice", rows_and_tokens, b.const([0]), b.const([1])),
                b.const([heads]),
                b.op("Slice", rows_and_tokens, b.const([1]), b.const([2])),
                axis=0,
            )
            blocks = b.op("GatherElements", table_i64, b.op("Div", places, b.const(block_size)), axis=1)
            columns = [
                b.op("Unsqueeze", blocks, b.const([1])),
                b.const(np.arange(heads).reshape(1, heads, 1)),
                b.op("Unsqueeze", b.op("Mod", places, b.const(block_size)), b.const([1])),
            ]
            columns = [b.op("Unsqueeze", b.op("Expand", c, grid), b.const([-1])) for c in columns]
            b.memo[key] = b.op("Concat", *columns, axis=-1)
    return b.memo[key]


def _page_indices(b: OnnxBuilder, table, kv_heads: int, block_size: int) -> tuple[str, str]:
    """(i64 [batch, kv_heads, blocks, 2] (block, head) pairs, i64 scalar blocks * block_size),
    `blocks` being those that hold the call's slots."""
    key = f"paged/indices/{kv_heads}/{block_size}"
    if key not in b.memo:
        table_i64 = _table(b, table)
        with shared_scope(b, "/model/paged"):
            total = b.op("Cast", TOTAL_LENGTH, to=elem_type("i64"))
            blocks = b.op("Div", b.op("Add", total, b.const(block_size - 1)), b.const(block_size))
            held = b.op("Slice", table_i64, b.const([0]), b.op("Unsqueeze", blocks, b.const([0])), b.const([1]))
            held = b.op("Unsqueeze", held, b.const([1]))  # [batch, 1, blocks]
            grid = b.op(
                "Concat", b.op("Shape", held, start=0, end=1), b.const([kv_heads]), b.op("Shape", held, start=2), axis=0
            )
            heads = b.const(np.arange(kv_heads).reshape(1, kv_heads, 1))
            pairs = [b.op("Unsqueeze", b.op("Expand", c, grid), b.const([-1])) for c in (held, heads)]
            b.memo[key] = (b.op("Concat", *pairs, axis=-1), b.op("Mul", blocks, b.const(block_size)))
    return b.memo[key]
