"""Addressing KV-buffer rows: what lets a scheduler put each request in its own slot.

A compiled step reads and writes cache rows [0, batch). To run one request that lives in row
`first_row`, a backend that cannot offset its bindings swaps the slots that request uses to the
front, runs, and swaps them back (`run_at_rows`): a few MB of copies per call, small beside the
prefill chunk that needs it (decode steps run every slot at once from row 0 and never swap).
Prefix caching copies the keys and values of a shared prefix from one row to another
(`copy_prefix`; beam search forks its beams so), contrastive search single slots (`copy_slots`).
Both work on zero-copy torch views of a backend's buffers (`Executable.cache_views`),
[max_batch, kv_heads, max_seq_len, head_dim] each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from kiln.backends.errors import FeedError
from kiln.ir.errors import KilnError


class RowAddressError(KilnError, ValueError):
    """A call names cache rows that do not exist or overlap the rows it must swap with."""


class LazyViews(Sequence):
    """A backend's cache views, made on first use: most calls (a decode from row 0, an unpadded
    chunk) read none, and viewing SmolLM2's 60 tinygrad buffers costs ~1.3 ms, a fifth of an int4
    decode step."""

    def __init__(self, make: Callable[[], list[torch.Tensor]]):
        self._make = make
        self._views: list[torch.Tensor] | None = None

    def _made(self) -> list[torch.Tensor]:
        if self._views is None:
            self._views = self._make()
        return self._views

    def __getitem__(self, index):
        return self._made()[index]

    def __len__(self) -> int:
        return len(self._made())


def int64_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int64 (tokens, positions), without a torch op when it already is one."""
    if t.dtype != torch.int64:
        t = t.to(torch.int64)
    return t if t.is_contiguous() else t.contiguous()


def checked_feeds(
    tokens: torch.Tensor, positions: torch.Tensor, max_batch: int, max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous int64 tokens/positions [batch, seq] with batch <= max_batch and every position in
    [0, max_seq_len); raises FeedError saying which does not hold. Checked
    with numpy: after a model step, torch ops here cost ~0.1 ms each (cold dispatcher)."""
    if tokens.dim() != 2 or tokens.shape != positions.shape:
        raise FeedError(f"tokens {list(tokens.shape)} and positions {list(positions.shape)} must both be [batch, seq]")
    if tokens.size(0) > max_batch:
        raise FeedError(f"batch {tokens.size(0)} exceeds max_batch {max_batch}; compile with a larger max_batch")
    tokens, positions = int64_contiguous(tokens), int64_contiguous(positions)
    flat = positions.numpy().reshape(-1)
    low, high = int(flat.min()), int(flat.max())
    if low < 0 or high >= max_seq_len:
        raise FeedError(f"positions must lie in [0, {max_seq_len}), got [{low}, {high}]")
    return tokens, positions


def check_rows(first_row: int, batch: int, max_batch: int) -> None:
    if first_row < 0 or first_row + batch > max_batch:
        raise RowAddressError(
            f"cache rows [{first_row}, {first_row + batch}) lie outside the {max_batch} "
            "compiled rows. Fix: address rows below max_batch (compile with a larger max_batch)."
        )


def run_at_rows(
    run: Callable[..., torch.Tensor],
    views: Sequence[torch.Tensor],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    first_row: int,
    tree_feeds: tuple = (),
    swap: Callable[[int, int, int], None] | None = None,
) -> torch.Tensor:
    """`run(tokens, positions, *tree_feeds)` (which uses rows [0, batch)) against rows
    [first_row, first_row + batch); tree_feeds are (slots, tree) where the graph takes them.
    `swap(batch, first_row, used)` exchanges the rows' first `used` slots (at least), by default
    through `views`; a backend whose buffers torch cannot view passes its own."""
    batch = tokens.size(0)
    if first_row == 0:
        return run(tokens, positions, *tree_feeds)
    if first_row < batch:
        raise RowAddressError(
            f"rows [{first_row}, {first_row + batch}) overlap rows [0, {batch}); run such a call one row at a time"
        )
    # a query reads slots <= its own; the call writes no further
    used = int((tree_feeds[0] if tree_feeds else positions).max()) + 1
    swap = swap or functools.partial(_swap, views)
    swap(batch, first_row, used)
    try:
        return run(tokens, positions, *tree_feeds)
    finally:
        swap(batch, first_row, used)


def _swap(views: Sequence[torch.Tensor], batch: int, first_row: int, used: int) -> None:
    for cache in views:
        front, rows = cache[:batch, :, :used], cache[first_row : first_row + batch, :, :used]
        saved = front.clone()
        front.copy_(rows)
        rows.copy_(saved)


def copy_prefix(views: Sequence[torch.Tensor], source_row: int, target_row: int, length: int) -> None:
    """Copy the keys and values of slots [0, length) from one row to another."""
    copy_slots(views, source_row, target_row, 0, length)


def copy_slots(
    views: Sequence[torch.Tensor], source_row: int, target_row: int, start: int, end: int, to_start: int | None = None
) -> None:
    """Copy the keys and values of slots [start, end) from one row to another (to slots from
    `to_start` when given: a slot moved within one row)."""
    to_start = start if to_start is None else to_start
    if (source_row, start) != (target_row, to_start) and end > start:
        for cache in views:
            cache[target_row, :, to_start : to_start + end - start].copy_(cache[source_row, :, start:end])
