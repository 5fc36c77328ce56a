"""Preemption over a paged KV cache: what the engine does when the pool has no block left.

Recompute, not swap: the youngest running request (the last admitted) gives its blocks back and
waits again at the head of the queue, keeping its prompt, generated tokens and sampler state.
When it is admitted again its prompt and generated tokens are fed as prompt chunks (blocks it
filled earlier may still be registered, and are shared back instead of recomputed), and the logits
after its newest token sample its next one, as the decode step it missed would have: its output
is the one it would have had without the interruption.
"""

from __future__ import annotations

import torch

from kiln.runtime.request import RequestStatus


def make_room(engine, requests: list, count: int) -> list:
    """The requests (oldest first) whose lanes now have blocks for their next `count` slots;
    to find them, the youngest running requests are preempted, `requests` among them when they
    are the youngest (those are left out)."""
    ready = []
    for request in sorted(requests, key=engine.running.index):
        while request in engine.running and not engine.slots.reserve(request.kv_row, request.fed + count):
            preempt(engine, engine.running[-1])
        if request in engine.running:
            ready.append(request)
    return ready


def preempt(engine, request) -> None:
    """Free `request`'s blocks and queue it first, to be fed again from its start."""
    engine.running.remove(request)
    engine.slots.release(request.kv_row)
    request.kv_row, request.fed = None, 0
    request.status = RequestStatus.WAITING
    request.preemptions += 1
    engine.preemptions += 1
    with engine._lock:
        engine.waiting.appendleft(request)


def table_feed(blocks, lanes: list[int | None]) -> dict:
    """run()'s `block_table` for a call over `lanes` (None: a row of scratch)."""
    return {"block_table": torch.from_numpy(blocks.table(lanes))}


def decode_table_feed(blocks, requests: list, batch_rows: int) -> dict:
    """A decode call's block table: the decoding requests' blocks in their lanes, scratch in the
    lanes it does not feed (where the static layout writes placeholders into free rows)."""
    lanes: list[int | None] = [None] * batch_rows
    for request in requests:
        lanes[request.kv_row] = request.kv_row
    return table_feed(blocks, lanes)


def block_copier(executable):
    """Copy-on-write of a block (kv_blocks.py): every pool's keys and values (and scales)."""

    def copy(source: int, target: int) -> None:
        for pool in executable.cache_views():
            pool[target].copy_(pool[source])

    return copy
