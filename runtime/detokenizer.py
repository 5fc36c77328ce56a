"""Incremental decoding for streaming: emit text as tokens arrive, never half a character.

Decoding tokens one at a time is wrong in two ways: a byte-level BPE piece may hold only part of
a UTF-8 character (decoding it alone gives U+FFFD), and sentencepiece-style decoders drop or
add spaces depending on what comes before. So, like Hugging Face TGI, each step decodes a short
window of recent tokens twice (with and without the newest ones) and emits the difference once
it no longer ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Feed token ids with `push`; get back the new complete text (possibly ""). `finish` returns
    whatever is left, so the pieces always concatenate to `decode(all ids)`."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are already emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        current = self._decode(self.ids[self._prefix_offset :])
        if len(current) > len(prefix) and not current.endswith(REPLACEMENT):
            piece = current[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self.text += piece
            return piece
        return ""

    def finish(self) -> str:
        """The text not emitted yet (e.g. a trailing incomplete character, as U+FFFD)."""
        full = self._decode(self.ids)
        piece = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += piece
        self._prefix_offset = self._read_offset = len(self.ids)
        return piece
