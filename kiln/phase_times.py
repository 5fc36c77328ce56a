"""How long each compile phase took before, to estimate the next compile's (the progress ETA).

Recorded in the compile cache's directory (phase_times.json) per backend and quantization
scheme, with the size of the checkpoint's weights: a phase's estimate is its latest time for
the nearest size within a factor of two, scaled by the size ratio. Nothing nearer means no
estimate (the display shows a spinner with the elapsed time instead).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

FILE = "phase_times.json"
KEPT_PER_PHASE = 8  # the latest records of each (group, phase)
NEAR = math.log(2.0)  # sizes further apart than 2x say little about each other's times


class PhaseTimes:
    """The recorded phase times under `directory` (None: nothing is read or written)."""

    def __init__(self, directory: Path | None, group: str):
        self.path = directory / FILE if directory is not None else None
        self.group = group
        self.records = self._read()
        self.pending: list[tuple[str, int, float]] = []

    def estimate(self, phase: str, size: int | None) -> float | None:
        """Seconds `phase` should take for a checkpoint of `size` bytes, or None."""
        if not size:
            return None
        candidates = [(abs(math.log(size / s)), s, t) for s, t in self.records.get(self._key(phase), []) if s > 0]
        if not candidates:
            return None
        distance, recorded_size, seconds = min(candidates)
        return seconds * size / recorded_size if distance <= NEAR else None

    def add(self, phase: str, size: int | None, seconds: float) -> None:
        """Remember a finished phase; `save` writes what a successful compile added."""
        if size:
            self.pending.append((phase, size, seconds))

    def save(self) -> None:
        if self.path is None or not self.pending:
            return
        records = self._read()  # another compile may have written since
        for phase, size, seconds in self.pending:
            kept = [r for r in records.get(self._key(phase), []) if r[0] != size]
            records[self._key(phase)] = (kept + [[size, round(seconds, 2)]])[-KEPT_PER_PHASE:]
        self.pending = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=f".{FILE}.", dir=self.path.parent)
            with os.fdopen(handle, "w") as stream:
                json.dump({"version": 1, "records": records}, stream, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except OSError:
            pass  # estimates are a convenience: an unwritable cache must not fail a compile

    def _key(self, phase: str) -> str:
        return f"{self.group}/{phase}"

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            records = json.loads(self.path.read_text()).get("records", {})
        except (OSError, ValueError, AttributeError):
            return {}
        if not isinstance(records, dict):
            return {}
        return {key: [r for r in value if _is_record(r)] for key, value in records.items() if isinstance(value, list)}


def _is_record(record) -> bool:
    """[size in bytes, seconds], as `save` writes them (a hand-edited file may hold anything)."""
    return (
        isinstance(record, list)
        and len(record) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in record)
    )
