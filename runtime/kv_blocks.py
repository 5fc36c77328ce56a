"""`KvBlocks`: the engine's bookkeeping for a paged KV cache (ir/ops/paged_kv.py), in place of
`KvSlots`' rows.

The pool's blocks (block_size slots each, every layer alike) are handed out one at a time as a
request's tokens reach them, and counted by reference:
- a request holds a *lane* (its row of the call's block table, at most max_batch of them: what
  the decode call batches) and the list of its blocks; slot s sits in blocks[s // block_size];
- a block whose block_size tokens are all written is *registered* under the token ids from the
  sequence's start to its end: a later request whose tokens start the same way takes a reference
  to it instead of computing it again (prefix sharing, in place of copying rows);
- a shared block is never written: a request that must write into one (its prompt's last token
  falls inside a cached block, since that token is always fed again) gets a private copy first
  (copy-on-write);
- when a request ends, its blocks lose a reference; at zero a block is free, and a registered
  free block keeps its keys and values for a later request until the pool needs it (the least
  recently freed goes first).
Block 0 is the scratch block: it belongs to no request, so table entries past a row's blocks and
the lanes a call does not feed point at it (what is written there is never read).

Admission is by memory: a request is placed when the blocks its tokens need, plus one to grow
into, are free (a pool of one row's blocks still admits a request of max_seq_len tokens). A
request that needs a block when none is free is preempted by the engine (recompute: its blocks
are released and it waits again with its prompt and generated tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from kiln.runtime.kv_slots import Placement, shared_prefix

SCRATCH = 0  # the block no request owns


class KvBlocks:
    """Lanes, blocks and their reference counts, and the registry of full blocks by prefix."""

    def __init__(
        self,
        lanes: int,
        layout: dict,
        copy_block: Callable[[int, int], None],
        prefix_caching: bool = True,
    ):
        self.block_size, self.num_blocks = layout["block_size"], layout["num_blocks"]
        self.blocks_per_row = layout["blocks_per_row"]
        self.copy_block = copy_block  # (source, target): every layer's keys and values of a block
        self.prefix_caching = prefix_caching
        self.row_copies = True  # a prefix other requests hold is shared (by reference)
        self.occupant: list[object | None] = [None] * lanes
        self.contents: list[list[int]] = [[] for _ in range(lanes)]  # the token ids each lane's slots hold
        self.blocks: list[list[int]] = [[] for _ in range(lanes)]
        self.refs = [0] * self.num_blocks
        self.free_plain: list[int] = list(range(self.num_blocks - 1, SCRATCH, -1))  # popped from the end
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # registered and free, least recent first
        self.registry: dict[tuple[int, ...], int] = {}  # a full block's tokens from the start -> block
        self.key_of: dict[int, tuple[int, ...]] = {}

    # -- counts ----------------------------------------------------------------------------
    @property
    def in_use(self) -> int:
        """Lanes holding a request."""
        return sum(o is not None for o in self.occupant)

    @property
    def blocks_free(self) -> int:
        """Blocks no request holds (registered ones among them, kept until needed)."""
        return len(self.free_plain) + len(self.free_cached)

    @property
    def blocks_total(self) -> int:
        return self.num_blocks - 1  # the scratch block is never handed out

    @property
    def blocks_in_use(self) -> int:
        return self.blocks_total - self.blocks_free

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.block_size)

    # -- admission ---------------------------------------------------------------------------
    def shareable(self, prefilled: list[int], tokens: list[int], chunk: int | None = None) -> int:
        """How many of `tokens` a request could share once another request has fed `prefilled`."""
        return shared_prefix(prefilled, tokens)

    def place(self, tokens: list[int], chunk: int | None = None) -> Placement | None:
        """A free lane for a request that will feed `tokens`, reusing the registered blocks its
        tokens start with; None when no lane is free or too few blocks are (it waits). Unlike
        `KvSlots`, any registered block is reused, whatever call computed it (`chunk` is unused)."""
        lane = next((i for i, o in enumerate(self.occupant) if o is None), None)
        if lane is None:
            return None
        shared = self._shared_prefix(tokens)
        reused = min(len(shared) * self.block_size, len(tokens) - 1)  # the last token is fed again
        kept = reused // self.block_size  # shared blocks left unwritten; one holding `reused` is copied
        if self._fits(tokens, shared[: kept + 1], kept):
            return Placement(lane, reused)
        if reused % self.block_size and self._fits(tokens, shared[:kept], kept):  # no room to copy one
            return Placement(lane, kept * self.block_size)
        return None

    def _fits(self, tokens: list[int], taken: list[int], kept: int) -> bool:
        """Whether the free blocks hold what a request needs: its tokens' blocks beyond the `kept`
        shared ones, one to grow into (unless it would then hold a whole row), and the `taken`
        shared blocks that are free now (a block copied on write is taken while it is copied)."""
        blocks = self.blocks_for(len(tokens))
        needed = blocks - kept + (1 if blocks < self.blocks_per_row else 0)
        revived = sum(1 for block in taken if self.refs[block] == 0)
        return self.blocks_free - revived >= needed

    def _shared_prefix(self, tokens: list[int]) -> list[int]:
        """The registered blocks holding tokens' first full blocks, in order."""
        if not self.prefix_caching:
            return []
        found = []
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            block = self.registry.get(tuple(tokens[:end]))
            if block is None:
                break
            found.append(block)
        return found

    def occupy(self, lane: int, occupant: object, tokens: list[int], reused: int) -> None:
        """Give `lane` to a request that feeds `tokens`, the first `reused` from shared blocks:
        takes their references (a copy of the one `reused` falls in) and the blocks for the rest."""
        shared = self._shared_prefix(tokens)[: self.blocks_for(reused)]
        self.occupant[lane], self.contents[lane], self.blocks[lane] = occupant, list(tokens[:reused]), []
        for block in shared:
            self._take(block)
            self.blocks[lane].append(block)
        if reused % self.block_size:  # written into from `reused` on: a private copy
            self._write_private(lane, len(shared) - 1)
        if not self.reserve(lane, len(tokens)):
            raise AssertionError("placed without the blocks its tokens need")  # place() counted them

    # -- growth ------------------------------------------------------------------------------
    def reserve(self, lane: int, end: int) -> bool:
        """Blocks for the lane's slots up to `end` (exclusive); False when the pool has none left."""
        blocks = self.blocks[lane]
        while len(blocks) < self.blocks_for(end):
            block = self._allocate()
            if block is None:
                return False
            blocks.append(block)
        return True

    def _write_private(self, lane: int, index: int) -> None:
        """Copy-on-write: the lane's block `index`, shared or registered, replaced by its own copy."""
        source = self.blocks[lane][index]
        copy = self._allocate()
        self.copy_block(source, copy)
        self.blocks[lane][index] = copy
        self._drop(source)

    def fed(self, lane: int, tokens: list[int], position: int) -> None:
        """Tokens were written at slots [position, position + len(tokens)): blocks they filled
        are registered under their prefix."""
        contents = self.contents[lane]
        del contents[position:]
        contents.extend(tokens)
        if not self.prefix_caching:
            return
        first, last = position // self.block_size, len(contents) // self.block_size
        for index in range(first, last):
            block = self.blocks[lane][index]
            key = tuple(contents[: (index + 1) * self.block_size])
            if block not in self.key_of and key not in self.registry:
                self.registry[key], self.key_of[block] = block, key

    def scribbled(self, lane: int, position: int) -> None:
        """A placeholder was written at `position`: the contents end before it."""
        del self.contents[lane][position:]

    def release(self, lane: int) -> None:
        """The request in `lane` ended (or was preempted): its blocks lose its reference."""
        for block in self.blocks[lane]:
            self._drop(block)
        self.occupant[lane], self.blocks[lane], self.contents[lane] = None, [], []

    def forget(self) -> None:
        """Forget every registered block (the executable was used outside the engine)."""
        for block in list(self.key_of):
            self._unregister(block)
        self.free_plain.extend(self.free_cached)
        self.free_cached.clear()

    # -- the call's table --------------------------------------------------------------------
    def table(self, lanes: list[int | None]) -> np.ndarray:
        """i32 [len(lanes), blocks_per_row]: each lane's blocks (None: a row of scratch)."""
        table = np.zeros((len(lanes), self.blocks_per_row), dtype=np.int32)
        for row, lane in enumerate(lanes):
            if lane is not None:
                blocks = self.blocks[lane]
                table[row, : len(blocks)] = blocks
        return table

    # -- reference counts ----------------------------------------------------------------------
    def _allocate(self) -> int | None:
        if self.free_plain:
            block = self.free_plain.pop()
        elif self.free_cached:
            block, _ = self.free_cached.popitem(last=False)
            self._unregister(block)
        else:
            return None
        self.refs[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.free_cached.pop(block, None)
        self.refs[block] += 1

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.free_cached[block] = None
            else:
                self.free_plain.append(block)

    def _unregister(self, block: int) -> None:
        key = self.key_of.pop(block, None)
        if key is not None and self.registry.get(key) == block:
            del self.registry[key]
