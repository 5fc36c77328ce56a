"""`KvSlots`: which request holds each row of the static KV buffers, and which tokens each row's
cache still holds, for prefix caching.

Every row remembers the token ids whose keys and values sit in its slots [0, n) (`contents`).
A row keeps them after its request finishes, so a new request that starts with the same tokens
(a system prompt, a chat history, the same prompt again) skips prefilling them: it takes the
free row that shares the longest prefix, or, when a busy row shares a longer one, gets that
prefix copied into its row (`copy_prefix`). At least the prompt's last token is always fed
again: its logits choose the first new token.

Only as much is reused as leaves the request's results bit for bit those of a fresh prefill
(exact_reuse.py): each row also remembers which call computed each slot (`labels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.exact_reuse import Label, call_labels, exact_reuse, prefill_labels


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many of `prompt`'s tokens `cached` starts with, short of its last: the last prompt
    token is always fed again, for the logits that choose the first new token."""
    return min(common_prefix_length(cached, prompt), len(prompt) - 1)


@dataclass
class Placement:
    """Where a new request goes: its row, how many prompt tokens it reuses, the row to copy
    them from (None when they already sit in its own row) and their slots' call labels."""

    row: int
    reused: int
    copy_from: int | None = None
    labels: list[Label] = field(default_factory=list)


class KvSlots:
    """The rows of the KV buffers: their occupants and cached contents."""

    def __init__(self, rows: int, prefix_caching: bool = True, row_copies: bool = True, exact_width: int | None = None):
        self.occupant: list[object | None] = [None] * rows
        self.contents: list[list[int]] = [[] for _ in range(rows)]
        self.labels: list[list[Label]] = [[] for _ in range(rows)]  # the call that computed each slot
        self.exact_width = exact_width or 1  # none declared: only one-token calls (exact_reuse.py)
        self.prefix_caching = prefix_caching
        self.row_copies = row_copies  # False: a prefix is reused only in the row that holds it

    @classmethod
    def serving(cls, rows: int, prefix_caching: bool, capabilities) -> KvSlots:
        """The rows of an executable with these `Capabilities` (backends/executable.py)."""
        return cls(rows, prefix_caching, capabilities.copies_rows, capabilities.exact_width)

    @property
    def in_use(self) -> int:
        return sum(o is not None for o in self.occupant)

    def free_rows(self) -> list[int]:
        return [r for r, o in enumerate(self.occupant) if o is None]

    def place(self, prompt: list[int], chunk: int) -> Placement | None:
        """The best free row for `prompt`, which the engine prefills `chunk` tokens a call (None if
        every row is busy)."""
        free = self.free_rows()
        if not free:
            return None
        if not self.prefix_caching:
            return Placement(free[0], 0)
        shared = {r: self.reusable(r, prompt, chunk) for r in range(len(self.occupant))}
        row = max(free, key=lambda r: (shared[r], -r))
        donor = max(range(len(self.occupant)), key=lambda r: (shared[r], r == row))
        if shared[donor] > shared[row] and self.row_copies:
            return Placement(row, shared[donor], donor, self.labels[donor][: shared[donor]])
        return Placement(row, shared[row], None, self.labels[row][: shared[row]])

    def reusable(self, row: int, prompt: list[int], chunk: int) -> int:
        """How many of `prompt`'s tokens `row` holds with the bits a fresh prefill would compute."""
        shared = shared_prefix(self.contents[row], prompt)
        return exact_reuse(self.labels[row], shared, len(prompt), chunk, self.exact_width) if shared else 0

    def shareable(self, prefilled: list[int], prompt: list[int], chunk: int) -> int:
        """How many of `prompt`'s tokens it could reuse from a row that prefills `prefilled`."""
        shared = shared_prefix(prefilled, prompt)
        labels = prefill_labels(0, len(prefilled), chunk, self.exact_width)
        return exact_reuse(labels, shared, len(prompt), chunk, self.exact_width)

    def occupy(self, row: int, occupant: object, kept: list[int], labels: list[Label]) -> None:
        """Give `row` to a request; its cache keeps the first len(kept) tokens' keys and values,
        computed by the calls `labels` names."""
        self.occupant[row] = occupant
        self.contents[row] = list(kept)
        self.labels[row] = list(labels[: len(kept)])

    def fed(self, row: int, tokens: list[int], position: int, width: int | None = None) -> None:
        """Tokens were written at slots [position, position + len(tokens)) of `row` by a call
        feeding the row `width` tokens from `position` (default: just these)."""
        contents, labels = self.contents[row], self.labels[row]
        del contents[position:], labels[position:]
        contents.extend(tokens)
        labels.extend(call_labels(position, width or len(tokens), self.exact_width)[: len(tokens)])

    def scribbled(self, row: int, position: int) -> None:
        """A placeholder was written at slot `position`: the cached contents end before it."""
        del self.contents[row][position:], self.labels[row][position:]

    def release(self, row: int) -> None:
        self.occupant[row] = None

    def forget(self) -> None:
        """Forget every row's cached contents (the executable was used outside the engine)."""
        self.contents = [[] for _ in self.contents]
        self.labels = [[] for _ in self.labels]
