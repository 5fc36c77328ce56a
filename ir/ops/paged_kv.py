"""The paged KV cache's ops: where a row's slots live in a pool of blocks.

A paged cache holds, per layer, one pool `[num_blocks, kv_heads, block_size, head_dim]` shared by
every request, and each call is given a `block_table` i32 [batch, blocks_per_row]: slot s of row b
lives in block `block_table[b, s // block_size]` at offset `s % block_size`. So memory follows the
tokens a request holds (a block at a time), and requests that share a prefix share its blocks.

- `kv_write(pool, new, slots, block_table)` (attention.py) writes token t of row b at that place;
- `kv_pages(pool, block_table)` -> [batch, kv_heads, blocks_per_row * block_size, head_dim] is the
  row's slots in order, what `attention` reads as a static cache row (slots a row has no block for
  point at any block: they lie past every query's position, so no query sees them).
"""

from __future__ import annotations

import torch

from ..dims import dims_equal
from ..registry import OpDef, OpError, register


def check_block_table(table, batch, where: str) -> None:
    if table.dtype != "i32" or table.rank != 2 or not dims_equal(table.shape[0], batch):
        raise OpError(f"{where}: block_table must be i32 [batch, blocks_per_row] with batch {batch}, got {table}")


def _kv_pages_infer(pool, table):
    if pool.rank != 4:
        raise OpError(f"kv_pages: the pool must be [num_blocks, kv_heads, block_size, head_dim], got {pool}")
    check_block_table(table, table.shape[0], "kv_pages")
    _, kv_heads, block_size, last = pool.shape
    return pool.with_shape((table.shape[0], kv_heads, table.shape[1] * block_size, last))


def kv_pages_reference(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    batch, blocks = table.shape
    _, kv_heads, block_size, last = pool.shape
    rows = pool[table.long()]  # [batch, blocks, kv_heads, block_size, last]
    return rows.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, blocks * block_size, last)


def paged_write_index(new: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, block_size: int):
    """(block, head, offset) of each new key: token t of row b goes to slot slots[b, t]."""
    blocks = torch.gather(table.long(), 1, slots // block_size)[:, None, :]
    heads = torch.arange(new.size(1), device=new.device)[None, :, None]
    return blocks, heads, (slots % block_size)[:, None, :]


register(
    OpDef(
        "kv_pages",
        ("pool", "block_table"),
        _kv_pages_infer,
        kv_pages_reference,
        doc="[batch, kv_heads, blocks_per_row * block_size, d]: each row's slots gathered from the pool by its blocks",
    )
)
