"""`KvSlots`: which request holds each row of the static KV buffers, and which tokens each row's
cache still holds, for prefix caching.

Every row remembers the token ids whose keys and values sit in its slots [0, n) (`contents`).
A row keeps them after its request finishes, so a new request that starts with the same tokens
(a system prompt, a chat history, the same prompt again) skips prefilling them: it takes the
free row that shares the longest prefix, or, when a busy row shares a longer one, gets that
prefix copied into its row (`copy_prefix`). At least the prompt's last token is always fed
again: its logits choose the first new token.
"""

from __future__ import annotations

from dataclasses import dataclass


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Placement:
    """Where a new request goes: its row, how many prompt tokens it reuses, and the row to copy
    them from (None when they already sit in its own row)."""

    row: int
    reused: int
    copy_from: int | None = None


class KvSlots:
    """The rows of the KV buffers: their occupants and cached contents."""

    def __init__(self, rows: int, prefix_caching: bool = True, row_copies: bool = True):
        self.occupant: list[object | None] = [None] * rows
        self.contents: list[list[int]] = [[] for _ in range(rows)]
        self.prefix_caching = prefix_caching
        self.row_copies = row_copies  # False: a prefix is reused only in the row that holds it

    @property
    def in_use(self) -> int:
        return sum(o is not None for o in self.occupant)

    def free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.occupant) if o is None]

    def place(self, prompt: list[int]) -> Placement | None:
        """The best free row for `prompt` (None if every row is busy)."""
        free = self.free_rows()
        if not free:
            return None
        if not self.prefix_caching:
            return Placement(free[0], 0)
        usable = len(prompt) - 1  # the last prompt token is fed again for its logits
        shared = {r: min(common_prefix_length(self.contents[r], prompt), usable) for r in range(len(self.occupant))}
        row = max(free, key=lambda r: (shared[r], -r))
        donor = max(range(len(self.occupant)), key=lambda r: (shared[r], r == row))
        if shared[donor] > shared[row] and self.row_copies:
            return Placement(row, shared[donor], copy_from=donor)
        return Placement(row, shared[row])

    def occupy(self, row: int, occupant: object, kept: list[int]) -> None:
        """Give `row` to a request; its cache keeps the first len(kept) tokens' keys and values."""
        self.occupant[row] = occupant
        self.contents[row] = list(kept)

    def fed(self, row: int, tokens: list[int], position: int) -> None:
        """Tokens were written at slots [position, position + len(tokens)) of `row`."""
        contents = self.contents[row]
        del contents[position:]
        contents.extend(tokens)

    def scribbled(self, row: int, position: int) -> None:
        """A placeholder was written at slot `position`: the cached contents end before it."""
        del self.contents[row][position:]

    def release(self, row: int) -> None:
        self.occupant[row] = None

    def forget(self) -> None:
        """Forget every row's cached contents (the executable was used outside the engine)."""
        self.contents = [[] for _ in self.contents]
