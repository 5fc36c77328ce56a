"""How long `kiln.load` takes, each load in a fresh process after the imports.

    .venv/bin/python bench/load_time.py out/a.kiln [out/b.kiln ...] [--reps 3]
        [--baseline-python /other/tree/.venv/bin/python]

Each repetition loads every artifact once in a new interpreter that has already imported torch,
numpy, tinygrad and Kiln's modules (so the figure is the load itself: reading and checking the
files, parsing the graph, readying the backend). `--baseline-python` runs the same loads with
another tree's interpreter (its Kiln), alternating with this one, so code before and after a change
is timed side by side. Writes bench/results/load-time.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from provenance import write_result

RESULTS = Path(__file__).parent / "results"
ONE_LOAD = """
import sys, time
import numpy, torch
import kiln, kiln.runtime.artifact, kiln.runtime.generate
from kiln.backends.registry import get_backend
from kiln.runtime.artifact import read_manifest
from pathlib import Path
get_backend(read_manifest(Path(sys.argv[1]))["backend"])
start = time.perf_counter()
kiln.load(sys.argv[1])
print(time.perf_counter() - start)
"""


def one_load(python: str, artifact: str) -> float:
    done = subprocess.run([python, "-c", ONE_LOAD, artifact], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--baseline-python", help="another tree's interpreter, timed alternately")
    parser.add_argument("--out", default="load-time.md")
    args = parser.parse_args(argv)
    pythons = {"this tree": sys.executable}
    if args.baseline_python:
        pythons["baseline"] = args.baseline_python
    times = {(name, a): [] for name in pythons for a in args.artifacts}
    with CpuMeter() as meter:
        for _ in range(args.reps):
            for name, python in pythons.items():
                for artifact in args.artifacts:
                    times[name, artifact].append(one_load(python, artifact))
                    print(f"{name:9} {artifact}: {times[name, artifact][-1]:.2f} s", flush=True)
    rows = ["| code | artifact | loads s | median s |", "| --- | --- | --- | ---: |"]
    for (name, artifact), values in times.items():
        listed = ", ".join(f"{v:.2f}" for v in values)
        rows.append(f"| {name} | {artifact} | {listed} | {statistics.median(values):.2f} |")
    report = "\n".join(rows) + f"\n\nOther processes' CPU during the run: {meter.result.other_cores:.2f} cores.\n"
    write_result(RESULTS / args.out, report, argv=sys.argv if argv is None else ["bench/load_time.py", *argv])
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
