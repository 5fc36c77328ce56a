"""Keeping a static-row engine's busy rows low while a batch drains.

A decode call spans rows [0, the highest decoding one], so a row freed below the highest would
cost a row of work every step until the batch drains. When no request waits for a row, the
engine moves the request in the highest busy row into the lowest free row below it, one move a
step, copying the slots it has fed (exact copies: its output is unchanged; rows of one call are
bit-identical wherever they sit).
"""

from __future__ import annotations

from kiln.backends.cache_rows import copy_prefix
from kiln.runtime.kv_slots import KvSlots

MOVE_WORTH = 4  # tokens a request must have left to be moved: a copy costs about a row of one step


def move_top_row_down(slots: KvSlots, executable, running: list) -> None:
    """Move the request in the highest busy row into the lowest free row below it, if any."""
    if not running:
        return
    top = max(running, key=lambda r: r.kv_row)
    free = slots.free_rows()
    if not free or free[0] > top.kv_row or top.max_new - len(top.tokens) < MOVE_WORTH:
        return
    source, target = top.kv_row, free[0]
    copy_prefix(executable.cache_views(), source, target, top.fed)
    slots.occupy(target, top, slots.contents[source][: top.fed], slots.labels[source])
    slots.release(source)  # its contents stay cached for a prompt that starts with them
    top.kv_row = target
