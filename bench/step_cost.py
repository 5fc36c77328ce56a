"""What a step over M tokens costs against a step over one: SmolLM2-135M, per backend and scheme.

    .venv/bin/python bench/step_cost.py                                   # inductor: fp32, int8, int4-g32
    .venv/bin/python bench/step_cost.py --backends inductor,onnxruntime --schemes none,int4-g32
    .venv/bin/python bench/step_cost.py --artifacts /tmp/art --m 1,8,16  # reuse compiled artifacts
    .venv/bin/python bench/step_cost.py --baseline old/ --baseline-schemes int4-g32  # + artifacts compiled before

Each cell times one `executable.run` over M tokens of one row (all logits), at positions 256..,
as speculative verification, a batched decode step or a prefill chunk makes; the median of
`--repeats` calls after two warm-up calls (`--across-m`: rounds of one call at every M in turn,
which the host's drifts cannot skew between M, though each M = 1 call then finds the caches as a
larger step left them). Reported per M: milliseconds, the ratio to M = 1, the
weight bytes read per second (each weight once per step: the roofline of a memory-bound step)
and the GFLOP/s of the step's linears (2 x parameters x M). Artifacts are compiled once into
`--artifacts` (`<backend>-<scheme>.kiln`, max_batch 16) and reused; weights are int8 or int4
for the lm_head and embedding too (`--quantize-embeddings`). The CPU time other processes took
is recorded per row; rows where others kept more than a quarter core busy are repeated up to
three times, then flagged `*`. `--baseline DIR` also times DIR's artifacts of
`--baseline-schemes` (compiled by an earlier commit: their graphs call the ops they were
compiled with), call by call in turn with the current artifact, each table after the one it
compares with. Writes bench/results/step_cost.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from provenance import cpu_name, write_result

RESULTS = Path(__file__).parent / "results"
START_POSITION = 256


def artifact(directory: Path, backend: str, scheme: str):
    """Load (compiling first if missing) SmolLM2-135M for `backend` and weight `scheme`."""
    import kiln

    out = directory / f"{backend}-{scheme}.kiln"
    if not (out / "manifest.json").exists():
        quantized = scheme != "none"
        kiln.compile(
            None,
            out=out,
            backend=backend,
            max_seq_len=1024,
            max_batch=16,
            quantize=scheme if quantized else None,
            quantize_embeddings=quantized,
        )
    return kiln.load(out)


def weight_bytes(llm) -> int:
    """Bytes of the weights one step reads (every weight tensor once; the tied embedding once)."""
    seen, total = set(), 0
    for tensor in llm.graph.weights.values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def linear_parameters(llm) -> int:
    """Multiply-adds per token of the linears: every 2-D weight's elements (the lm_head counted
    once, whether tied to the embedding or not)."""
    return sum(t.numel() for t in {t.data_ptr(): t for t in llm.graph.weights.values()}.values() if t.dim() == 2)


def feeds(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m tokens of row 0 at positions 256.."""
    tokens = torch.randint(100, 20000, (1, m), generator=torch.Generator().manual_seed(m))
    return tokens, torch.arange(START_POSITION, START_POSITION + m).unsqueeze(0)


def timed_rounds(llms: list, ms: list[int], repeats: int) -> tuple[dict, float]:
    """Seconds of each (artifact, M) call over `repeats` rounds, each round one call of every
    artifact at every M in turn (after two warm-up rounds), and others' cores meanwhile."""
    inputs = {m: feeds(m) for m in ms}
    seconds = {(i, m): [] for i in range(len(llms)) for m in ms}
    for _ in range(2):
        for m in ms:
            for llm in llms:
                llm.executable.run(*inputs[m])
    with CpuMeter() as meter:
        for _ in range(repeats):
            for m in ms:
                for i, llm in enumerate(llms):
                    start = time.perf_counter()
                    llm.executable.run(*inputs[m])
                    seconds[(i, m)].append(time.perf_counter() - start)
    return seconds, meter.result.other_cores


def measure(llms: list, ms: list[int], repeats: int, across_m: bool) -> list[list[dict]]:
    """Rows per artifact: the median seconds per M, the artifacts taking turns call by call. With
    `across_m`, every round also goes over every M, so that a drift of the host (other machines'
    memory traffic moved a step's time by up to 2x within minutes here) falls on all cells alike;
    without, each M runs its own rounds, as a steady stream of such steps would (the caches as
    the previous step of the same M left them). Rounds where others kept more than a quarter
    core busy are run again up to three times, then flagged `*`."""
    rows = [[] for _ in llms]
    for group in [ms] if across_m else [[m] for m in ms]:
        for _attempt in range(3):
            seconds, others = timed_rounds(llms, group, repeats)
            if others <= 0.25:
                break
        for i, out in enumerate(rows):
            out += [{"m": m, "seconds": statistics.median(seconds[(i, m)]), "others": others} for m in group]
    return rows


def table(title: str, rows: list[dict], nbytes: int, params: int) -> list[str]:
    base = rows[0]["seconds"] if rows and rows[0]["m"] == 1 else None
    lines = [
        f"### {title}",
        "",
        "| M | ms | x M=1 | GB/s | GFLOP/s | others' cores |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        seconds, flag = row["seconds"], " *" if row["others"] > 0.25 else ""
        ratio = f"{seconds / base:.2f}" if base else ""
        lines.append(
            f"| {row['m']} | {seconds * 1e3:.1f}{flag} | {ratio} | {nbytes / seconds / 1e9:.1f} | "
            f"{2 * params * row['m'] / seconds / 1e9:.1f} | {row['others']:.2f} |"
        )
    return lines + [""]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="inductor")
    parser.add_argument("--schemes", default="none,int8,int4-g32")
    parser.add_argument("--m", default="1,2,4,8,16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--artifacts", type=Path, default=Path("out/step_cost"))
    parser.add_argument("--out", type=Path, default=RESULTS / "step_cost.md")
    parser.add_argument("--baseline", type=Path, help="a directory of artifacts compiled before, timed too")
    parser.add_argument("--baseline-schemes", default="int4-g32")
    parser.add_argument("--across-m", action="store_true", help="each round calls every M in turn")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ms = [int(m) for m in args.m.split(",")]
    lines = [
        f"SmolLM2-135M-Instruct, {args.threads} threads, one row, positions {START_POSITION}.., "
        f"{platform.processor() or platform.machine()} ({cpu_name()})",
        "",
    ]
    baseline_schemes = args.baseline_schemes.split(",") if args.baseline else []
    for backend in args.backends.split(","):
        for scheme in args.schemes.split(","):
            runs = [(args.artifacts, f"{backend} {scheme}")]
            if scheme in baseline_schemes:
                runs.append((args.baseline, f"{backend} {scheme}, baseline ({args.baseline})"))
            llms = [artifact(directory, backend, scheme) for directory, _title in runs]
            for llm, (_directory, title), rows in zip(llms, runs, measure(llms, ms, args.repeats, args.across_m)):
                block = table(title, rows, weight_bytes(llm), linear_parameters(llm))
                print("\n".join(block), flush=True)
                lines += block
            del llms
    write_result(args.out, "\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
