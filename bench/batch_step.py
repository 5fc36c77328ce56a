"""Where a batched decode step's time goes: one `executable.run` over B rows of one token each.

    .venv/bin/python bench/batch_step.py --artifact out/bench-throughput-inductor-b16-s512.kiln \
        [--rows 1,4,8,16] [--positions 24,150,280] [--repeats 9]

Every row's cache is filled to the position first (one prompt call per row), then each cell is
the median of `--repeats` decode calls over rows [0, B) at that position, as the engine's decode
step makes with B requests in flight, with the ratio to B = 1 at the same position. A profiled
pass of as many calls splits the step into Kiln's linears (`kiln::linear_f32` / `linear_i8` and
the quantized ops) and its attention (`kiln::cached_attention`), their mean per call, and the
rest of the median (Inductor's own kernels, the wrapper; negative where the profiled pass ran
slower). The CPU time other processes took is recorded per row (`*`:
more than a quarter core). Writes bench/results/batch_step[-SUFFIX].md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from provenance import write_result

RESULTS = Path(__file__).parent / "results"


def fill_rows(executable, rows: int, position: int) -> None:
    """Rows [0, rows) hold `position` slots of prompt (any tokens), as requests mid-reply do."""
    generator = torch.Generator().manual_seed(position)
    for row in range(rows):
        tokens = torch.randint(10, 1000, (1, position), generator=generator)
        executable.run(tokens, torch.arange(position)[None], first_row=row)


def decode_call(executable, rows: int, position: int):
    tokens = torch.full((rows, 1), 42, dtype=torch.int64)
    return lambda: executable.run(tokens, torch.full((rows, 1), position, dtype=torch.int64))


def split(call, repeats: int, total_ms: float) -> dict:
    """ms per call of the linears and the attention (their mean over a profiled pass of `repeats`
    calls), and the rest of the unprofiled median `total_ms`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            call()
    parts = {"linears": 0.0, "attention": 0.0}
    for event in prof.key_averages():
        if event.key.startswith("kiln::linear") or event.key.startswith("kiln::q"):
            parts["linears"] += event.self_cpu_time_total / 1e3 / repeats
        elif event.key == "kiln::cached_attention":
            parts["attention"] += event.self_cpu_time_total / 1e3 / repeats
    parts["rest"] = total_ms - parts["linears"] - parts["attention"]
    return parts


def measure(executable, rows: list[int], position: int, repeats: int) -> list[dict]:
    fill_rows(executable, max(rows), position)
    out = []
    for count in rows:
        call = decode_call(executable, count, position)
        call(), call()  # warm-up
        with CpuMeter() as meter:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
        total = 1e3 * statistics.median(times)
        out.append({"rows": count, "ms": total, "meter": meter.result, **split(call, repeats, total)})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="a compiled artifact with max_batch >= the most rows")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--positions", default="24,150,280")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--suffix", default="", help="results file: batch_step-SUFFIX.md")
    args = parser.parse_args(argv)
    import kiln

    torch.set_num_threads(args.threads)
    executable = kiln.load(args.artifact).executable
    rows = [int(r) for r in args.rows.split(",")]
    lines = [
        f"{Path(args.artifact).name}, {args.threads} threads: one decode call over B rows of one token each",
        "",
        "| position | rows | ms | x 1 row | linears ms | attention ms | rest ms | others' cores |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for position in (int(p) for p in args.positions.split(",")):
        cells = measure(executable, rows, position, args.repeats)
        for cell in cells:
            flag = " *" if cell["meter"].contended else ""
            lines.append(
                f"| {position} | {cell['rows']} | {cell['ms']:.1f}{flag} | {cell['ms'] / cells[0]['ms']:.2f} "
                f"| {cell['linears']:.1f} | {cell['attention']:.1f} | {cell['rest']:.1f} "
                f"| {cell['meter'].other_cores:.2f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    write_result(RESULTS / f"batch_step{'-' + args.suffix if args.suffix else ''}.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
