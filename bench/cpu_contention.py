"""How much CPU other processes took while we timed something.

These machines are shared: another process on one of the two cores can cut a decode benchmark's
speed several-fold. `CpuMeter` reads the machine's busy time from /proc/stat and subtracts this
process's own (and its children's) CPU time; what is left was someone else's.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CONTENDED_CORES = 0.25  # others using more than a quarter core on average: the run is flagged


def _machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Measurement:
    wall_s: float = 0.0
    other_cpu_s: float = 0.0

    @property
    def other_cores(self) -> float:
        """Average number of cores other processes kept busy during the measurement."""
        return self.other_cpu_s / self.wall_s if self.wall_s else 0.0

    @property
    def contended(self) -> bool:
        return self.other_cores > CONTENDED_CORES


class CpuMeter:
    """`with CpuMeter() as m: ...` then `m.result` holds wall time and others' CPU time."""

    def __enter__(self) -> CpuMeter:
        self._busy, self._own, self._wall = _machine_busy_seconds(), _own_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall
        busy = _machine_busy_seconds() - self._busy
        own = _own_seconds() - self._own
        self.result = Measurement(wall, max(0.0, busy - own))


def paired_medians(old, new, repeats: int) -> tuple[float, float, float]:
    """Median seconds of `old()` and of `new()` (each returns its own seconds), called turn by turn
    `repeats` times after two warm-up rounds, so that both see the same moments of the machine;
    and the cores other processes kept busy meanwhile."""
    times_old, times_new = [], []
    with CpuMeter() as meter:
        for r in range(repeats + 2):
            t_old, t_new = old(), new()
            if r >= 2:
                times_old.append(t_old)
                times_new.append(t_new)
    return statistics.median(times_old), statistics.median(times_new), meter.result.other_cores


def print_paired_rows(row_counts, time_row, old_name: str = "old", new_name: str = "new") -> None:
    """The markdown table of an old and a new op over M rows: `time_row(m)` gives (old seconds,
    new seconds, others' cores); a row others kept more than a quarter core busy during is
    measured again up to three times, then flagged `*`."""
    print(f"| M | {old_name} ms | x M=1 | {new_name} ms | x M=1 | new/old | others' cores |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for m in row_counts:
        for _attempt in range(3):
            old, new, others = time_row(m)
            if others <= 0.25:
                break
        base = base or (old, new)
        flag = "*" if others > 0.25 else ""
        print(
            f"| {m} | {old * 1e3:.2f} | {old / base[0]:.2f} | {new * 1e3:.2f} | {new / base[1]:.2f} | "
            f"{new / old:.2f} | {others:.2f}{flag} |",
            flush=True,
        )
