"""What `TextStream` iterates: (prompt index, text piece) pairs, then `results()`.

`EngineBatch` submits a list of prompts to the engine and relays their pieces in the order the
engine produces them; `Exclusive` runs a generation that needs the executable alone
(speculative decoding) once the engine is idle.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

from kiln.runtime.request import GenerationSettings
from kiln.runtime.request_handle import RequestHandle
from kiln.runtime.results import GenerationResult


class EngineBatch:
    """A list of prompts run through the engine; iterating submits them (unbounded by the queue
    limit: the caller waits for them anyway) and, unless the engine thread runs, steps the engine
    in the calling thread. Stopping the iteration early cancels the rest."""

    def __init__(self, engine, prompts: Sequence[list[int]], settings: GenerationSettings, seeds: Sequence[int]):
        self.engine, self.prompts, self.settings, self.seeds = engine, list(prompts), settings, list(seeds)
        self.handles: list[RequestHandle] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        events: queue.SimpleQueue = queue.SimpleQueue()
        self.handles = [
            self.engine.submit(p, self.settings, s, bounded=False, sink=events, tag=i, background=False)
            for i, (p, s) in enumerate(zip(self.prompts, self.seeds))
        ]
        remaining = len(self.handles)
        try:
            while remaining:
                while events.empty() and not self.engine.threaded:
                    self.engine.drive()  # steps in this thread (see Engine.drive)
                index, kind, payload = events.get()
                if kind == "piece":
                    yield index, payload
                elif kind == "error":
                    raise payload
                else:
                    remaining -= 1
        finally:
            for handle in self.handles:
                handle.cancel()  # a no-op for finished ones

    @property
    def prompt_count(self) -> int:
        return len(self.prompts)

    def results(self) -> list[GenerationResult]:
        return [handle.result() for handle in self.handles]


class Exclusive:
    """A generation (iterable of (prompt index, piece) pairs, with `prompt_count` and `results()`)
    run while the engine is idle."""

    def __init__(self, engine, generation):
        self.engine, self.generation = engine, generation

    def __iter__(self):
        with self.engine.exclusive():
            yield from self.generation

    @property
    def prompt_count(self) -> int:
        return self.generation.prompt_count

    def results(self) -> list[GenerationResult]:
        return self.generation.results()
