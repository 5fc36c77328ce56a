"""What `TextStream` iterates: (prompt index, text piece) pairs, then `results()`.

`EngineBatch` submits a list of prompts to the engine and relays their pieces in the order the
engine produces them; `Exclusive` runs a generation that needs the executable alone
(speculative decoding) once the engine is idle.
"""
from __future__ import annotations

import queue
from typing import Iterator, Sequence

from kiln.runtime.decode_loop import GenerationRequest
from kiln.runtime.request_handle import RequestHandle
from kiln.runtime.results import GenerationResult


class EngineBatch:
    """A list of prompts run through the engine; iterating submits them (unbounded by the queue
    limit: the caller waits for them anyway) and, unless the engine thread runs, steps the engine
    in the calling thread. Stopping the iteration early cancels the rest."""

    def __init__(self, engine, prompts: Sequence[list[int]], request: GenerationRequest, seeds: Sequence[int]):
        self.engine, self.prompts, self.request, self.seeds = engine, list(prompts), request, list(seeds)
        self.rows = self.prompts  # TextStream counts prompts by len(rows)
        self.handles: list[RequestHandle] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        events: queue.SimpleQueue = queue.SimpleQueue()
        self.handles = [self.engine.submit(p, self.request, s, bounded=False, sink=events, tag=i, background=False)
                        for i, (p, s) in enumerate(zip(self.prompts, self.seeds))]
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

    def results(self) -> list[GenerationResult]:
        return [handle.result() for handle in self.handles]


class Exclusive:
    """A generation (iterable of (row, piece) with `results()`) run while the engine is idle."""

    def __init__(self, engine, generation):
        self.engine, self.generation = engine, generation
        self.rows = generation.rows

    def __iter__(self):
        with self.engine.exclusive():
            yield from self.generation

    def results(self) -> list[GenerationResult]:
        return self.generation.results()
