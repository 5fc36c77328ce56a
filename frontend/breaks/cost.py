"""What graph breaks cost: time spent outside compiled graphs, measured, per break.

The captured function is run again (already compiled, so nothing is traced) with each graph
wrapped in a timer. Every stretch of a run that is not inside a graph is Python: Dynamo's guard
checks, the code a break sends back to the interpreter, and the caller's own code. A stretch
that follows graph `g` belongs to the break(s) that ended `g` or were met before the next graph
(`FoundBreak.gap_owner`); the stretch before the first graph to the breaks met before any graph.
Graphs run eagerly, so "inside" is the time of the same ATen ops without a break.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from .recording import DynamoCapture, FoundBreak, Workload

MIN_SECONDS = 0.2  # fast workloads run until this much time is measured, for stable means
MAX_RUNS = 100


@dataclass
class CostMeasurement:
    """Seconds per run of the workload, averaged over `runs`."""

    runs: int
    total_s: float  # one run of the workload, compiled
    inside_s: float  # of which inside compiled graphs
    eager_s: float  # one run without Dynamo, for comparison
    gap_after: dict[int, float] = field(default_factory=dict)  # fragment index (-1: before the first) -> s

    @property
    def outside_s(self) -> float:
        return max(self.total_s - self.inside_s, 0.0)


def measure_cost(capture: DynamoCapture, workload: Workload, fn, runs: int = 3) -> CostMeasurement:
    """Time at least `runs` runs of the captured workload (more for fast ones, up to `MIN_SECONDS`
    or `MAX_RUNS`), and the same of `fn` without Dynamo, each after one untimed warm-up."""
    workload(capture.optimized)  # warm-up: any last recompile happens here, untimed
    capture.timer.active = True
    total, inside, count = 0.0, 0.0, 0
    gaps: dict[int, float] = defaultdict(float)
    try:
        while count < runs or (total < MIN_SECONDS and count < MAX_RUNS):
            capture.timer.spans.clear()
            start = time.perf_counter()
            workload(capture.optimized)
            end = time.perf_counter()
            total += end - start
            count += 1
            inside += sum(stop - begin for _, begin, stop in capture.timer.spans)
            for owner, seconds in _gaps(capture.timer.spans, start, end):
                gaps[owner] += seconds
    finally:
        capture.timer.active = False
        capture.timer.spans.clear()
    eager = _time_eager(workload, fn, count)
    return CostMeasurement(count, total / count, inside / count, eager, {k: v / count for k, v in gaps.items()})


def _gaps(spans: list[tuple[int, float, float]], start: float, end: float):
    """(fragment before the gap, seconds) for each stretch of a run outside graphs."""
    previous, previous_end = -1, start
    for index, begin, stop in spans:
        yield previous, max(begin - previous_end, 0.0)
        previous, previous_end = index, stop
    yield previous, max(end - previous_end, 0.0)


def _time_eager(workload: Workload, fn, runs: int) -> float:
    workload(fn)
    start = time.perf_counter()
    for _ in range(runs):
        workload(fn)
    return (time.perf_counter() - start) / runs


def break_costs(breaks: list[FoundBreak], cost: CostMeasurement) -> dict[int, float]:
    """Seconds per run for each break (by position in `breaks`); a stretch shared by several
    breaks is split evenly between them."""
    owners: dict[int, list[int]] = defaultdict(list)
    for position, found in enumerate(breaks):
        owners[found.gap_owner].append(position)
    costs = {}
    for owner, positions in owners.items():
        for position in positions:
            costs[position] = cost.gap_after.get(owner, 0.0) / len(positions)
    return costs
