"""bench/throughput.py's split of a level's wall time: the executable's calls timed by kind while
the level runs, the executable's own `run` back afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from throughput import CallTimes, where_the_time_went


class Executable:
    def run(self, tokens, positions, **keywords):
        return tokens.shape


def test_calls_are_timed_by_kind_and_run_is_restored():
    executable = Executable()
    with CallTimes(executable, full=4) as calls:
        assert executable.run(torch.zeros(1, 9), None, first_row=2) == (1, 9)  # a prompt chunk
        executable.run(torch.zeros(4, 1), None)  # decode over all 4 rows
        executable.run(torch.zeros(3, 1), None)
        executable.run(torch.zeros(2, 1), None)
    assert calls.calls == {"prompt": 1, "decode_full": 1, "decode_fewer": 2}
    assert set(calls.seconds) == set(calls.calls)  # each kind's time kept beside its count
    assert "run" not in vars(executable)

    row = {"layout": "static", "concurrency": 4, "wall_s": 2.0, "calls": calls.calls}
    row["call_s"] = {"prompt": 0.5, "decode_full": 1.0, "decode_fewer": 0.3}
    line = where_the_time_went([row])[-1]
    assert line == "| static | 4 | 2.0 | 1.0 (50%, 1 calls) | 0.3 (15%, 2 calls) | 0.5 (25%, 1 calls) | 0.2 (10%) |"
