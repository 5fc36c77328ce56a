"""The pass manager: runs named passes phase by phase, verifying the graph after every one.

A `Pass` is a named function `Graph -> Graph` (it may edit the graph in place and return it).
`PassManager` runs the phases in order, calls `kiln.ir.verify` after each pass, records a
`PassRecord` (time, node counts) per pass, and with `dump_dir` writes the IR text after the
input (`00-captured.kir`) and after each phase (`01-canonicalize.kir`, ...). In tests,
`check_with_interpreter(feeds)` also runs the reference interpreter before and after each pass
and fails if the outputs moved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.ir import Graph, VerificationError, print_graph, run_graph, to_torch, verify
from kiln.ir.errors import KilnError


class PassError(KilnError, RuntimeError):
    """A pass broke the graph (verifier or interpreter check); the message names the pass."""


@dataclass(frozen=True)
class Pass:
    """A named graph transformation. A pass that changes the graph's inputs or outputs (KV-cache
    insertion) sets `preserves_signature=False`, and one that changes the results on purpose
    (weight quantization) sets `approximate=True`; both are exempt from the interpreter check."""

    name: str
    run: Callable[[Graph], Graph]
    preserves_signature: bool = True
    approximate: bool = False

    @property
    def checked(self) -> bool:
        """Whether check_with_interpreter compares the results before and after this pass."""
        return self.preserves_signature and not self.approximate

    def __call__(self, graph: Graph) -> Graph:
        return self.run(graph)


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: how long it took and how the node count changed."""

    phase: str
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int

    def __str__(self) -> str:
        return (
            f"{self.phase}/{self.name}: {self.nodes_before} -> {self.nodes_after} nodes in {self.seconds * 1e3:.1f} ms"
        )


class PassManager:
    """Runs `phases` (a list of `(phase_name, [Pass, ...])`) in order; see the module docstring."""

    def __init__(
        self,
        phases: list[tuple[str, list[Pass]]],
        dump_dir: str | Path | None = None,
        progress: Callable[[PassRecord], None] | None = None,
    ):
        self.phases = phases
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.progress = progress
        self.report: list[PassRecord] = []
        self._check_feeds: Mapping[str, torch.Tensor] | None = None
        self._atol = 1e-4

    def check_with_interpreter(self, sample_feeds: Mapping[str, torch.Tensor], atol: float = 1e-4) -> PassManager:
        """Test mode: compare interpreter outputs before and after every signature-preserving pass.
        Inputs a pass adds (KV buffers) are fed zeros when their shapes are static."""
        self._check_feeds, self._atol = dict(sample_feeds), atol
        return self

    def run(self, graph: Graph) -> Graph:
        """Run every phase on `graph`; returns the transformed graph. Fills `self.report`."""
        self.report = []
        try:
            verify(graph)
        except VerificationError as e:
            raise PassError(f"the graph given to the pass manager is invalid: {e}") from None
        self._dump(0, "captured", graph)
        expected = None  # interpreter outputs of the current graph, computed lazily
        for index, (phase, passes) in enumerate(self.phases, start=1):
            for pass_ in passes:
                if self._check_feeds is not None and pass_.checked and expected is None:
                    expected = run_graph(graph, self._feeds_for(graph))
                graph = self._run_one(phase, pass_, graph)
                if self._check_feeds is None:
                    continue
                if not pass_.checked:
                    expected = None
                    continue
                actual = run_graph(graph, self._feeds_for(graph))
                self._compare(phase, pass_, expected, actual)
                expected = actual
            self._dump(index, phase, graph)
        return graph

    def _run_one(self, phase: str, pass_: Pass, graph: Graph) -> Graph:
        nodes_before, start = len(graph.nodes), time.perf_counter()
        try:
            result = pass_(graph)
        except Exception as e:
            e.add_note(f"in pass {pass_.name!r} (phase {phase!r})")
            raise
        seconds = time.perf_counter() - start
        if not isinstance(result, Graph):
            raise PassError(f"pass {pass_.name!r} (phase {phase!r}) returned {type(result).__name__}, not a Graph")
        try:
            verify(result)
        except VerificationError as e:
            raise PassError(f"pass {pass_.name!r} (phase {phase!r}) left an invalid graph: {e}") from None
        record = PassRecord(phase, pass_.name, seconds, nodes_before, len(result.nodes))
        self.report.append(record)
        if self.progress is not None:
            self.progress(record)
        return result

    def _feeds_for(self, graph: Graph) -> dict[str, torch.Tensor]:
        feeds = dict(self._check_feeds)
        for v in graph.inputs:
            if v.name in feeds:
                continue
            if not all(isinstance(d, int) for d in v.type.shape):
                raise PassError(f"check_with_interpreter: no sample feed for input %{v.name}: {v.type}")
            feeds[v.name] = torch.zeros(v.type.shape, dtype=to_torch(v.type.dtype))
        return feeds

    def _compare(self, phase: str, pass_: Pass, expected: list, actual: list) -> None:
        where = f"pass {pass_.name!r} (phase {phase!r}) changed the graph's results"
        if len(expected) != len(actual):
            raise PassError(f"{where}: {len(expected)} outputs became {len(actual)}")
        for i, (want, got) in enumerate(zip(expected, actual)):
            if want.shape != got.shape or want.dtype != got.dtype:
                raise PassError(
                    f"{where}: output {i} was {want.dtype}{list(want.shape)}, is {got.dtype}{list(got.shape)}"
                )
            if not torch.allclose(got.double(), want.double(), rtol=0.0, atol=self._atol, equal_nan=True):
                diff = (got.double() - want.double()).abs().nan_to_num(float("inf")).max().item()
                raise PassError(f"{where}: output {i} differs by up to {diff:g} (atol {self._atol:g})")

    def _dump(self, index: int, phase: str, graph: Graph) -> None:
        if self.dump_dir is None:
            return
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        (self.dump_dir / f"{index:02d}-{phase}.kir").write_text(print_graph(graph))
