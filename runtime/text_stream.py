"""`TextStream`: what `LLM.stream` returns, an iterator of text that keeps the final results."""

from __future__ import annotations

from collections.abc import Iterator

from kiln.runtime.results import GenerationResult


class TextStream:
    """Iterate for text as it completes: str pieces for one prompt, (prompt index, piece) pairs
    for a list. `batches` are iterables of (row, piece) with `rows` and `results()`: an
    EngineBatch, or speculative generations of one prompt each. After the iteration, `results`
    holds the GenerationResults (as `generate` would have returned them: one result, or a list)."""

    def __init__(self, batches: list, single: bool):
        self._batches = batches
        self._single = single
        self._done: list[GenerationResult] = []
        self._iterator = self._pieces()

    def __iter__(self) -> Iterator:
        return self._iterator

    def __next__(self):
        return next(self._iterator)

    def _pieces(self):
        offset = 0
        for batch in self._batches:
            for index, piece in batch:
                yield piece if self._single else (offset + index, piece)
            self._done.extend(batch.results())
            offset += batch.prompt_count

    @property
    def results(self) -> GenerationResult | list[GenerationResult]:
        """The results; iterating to the end first if the caller has not."""
        for _ in self._iterator:
            pass
        return self._done[0] if self._single else list(self._done)
