"""Stop strings over streamed text: the text ends just before the first stop string.

Text that might be the start of a stop string is held back until the next piece decides it,
so nothing after (or part of) a stop string is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text pieces with `push`; it returns what is safe to emit and sets `stopped`."""

    def __init__(self, stop: Sequence[str] | str | None):
        if isinstance(stop, str):
            stop = [stop]
        self.stops = [s for s in (stop or []) if s]
        self.stopped = False
        self._held = ""

    def push(self, piece: str) -> str:
        """Add text; return the part that can be emitted now."""
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = self._longest_partial_stop(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, when generation ends for another reason."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial_stop(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
