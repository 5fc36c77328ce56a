"""The `block_table` feed of an executable whose KV cache is paged (ir/ops/paged_kv.py).

A paged graph takes, after its KV pools, `block_table` i32 [batch, blocks_per_row]: row b's slot
s lives in block block_table[b, s // block_size]. The runtime's engine owns the pool's blocks
(runtime/kv_blocks.py) and passes each call's table: `run(tokens, positions, block_table=...)`.
A paged call has no rows to address, so `first_row` stays 0; a static executable takes no table.
"""

from __future__ import annotations

import torch

from .errors import FeedError, LoweringError


def paged_layout(graph) -> dict | None:
    """The graph's paged layout (block_size, num_blocks, blocks_per_row), None for static rows."""
    meta = graph.meta.get("kv_cache", {})
    return meta if meta.get("layout") == "paged" else None


def layout_feeds(paged: dict | None, batch: int, first_row: int, block_table) -> tuple:
    """(block_table,) checked for a paged executable's call; () for a static one."""
    if paged is None:
        if block_table is not None:
            raise FeedError(
                "this artifact's KV cache is static rows and takes no block_table. "
                "Fix: drop block_table (address rows with first_row), or compile with --kv-layout paged."
            )
        return ()
    if block_table is None:
        raise FeedError(
            "this artifact's KV cache is paged: run() needs block_table i32 [batch, "
            f"{paged['blocks_per_row']}] naming each row's blocks (the engine passes it). Fix: pass "
            "block_table, or compile with --kv-layout static for calls that address rows."
        )
    if first_row:
        raise FeedError("a paged call addresses blocks through block_table, not rows: first_row must be 0")
    table = torch.as_tensor(block_table)
    if table.shape != (batch, paged["blocks_per_row"]):
        raise FeedError(f"block_table must be [{batch}, {paged['blocks_per_row']}], got {list(table.shape)}")
    table = table.to(torch.int32).contiguous()
    flat = table.numpy().reshape(-1)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= paged["num_blocks"]):
        raise FeedError(f"block_table names blocks outside [0, {paged['num_blocks']}): [{flat.min()}, {flat.max()}]")
    return (table,)


def refuse_paged(graph, backend: str) -> None:
    """For a backend whose kv_write and attention address static rows: a paged graph is an error."""
    if paged_layout(graph) is not None:
        raise LoweringError(
            f"the {backend} backend cannot run a paged KV cache (its kv_write and attention lowerings "
            "address static rows, not blocks through a block table). Fix: compile with --kv-layout "
            "static, or --backend inductor (or reference) for a paged cache."
        )
