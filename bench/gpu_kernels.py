"""Kiln's two Triton decode kernels against what they replace, per shape, in one short GPU run
(`bash bench/gpu_run.sh kernels OUT`). bench/results/gpu-h200-kernels.md found both slower than
the defaults end to end; this says per kernel and shape by how much, and whether launch
parameters are why.

    python bench/gpu_kernels.py --out OUT/kernels.md [--budget 135] [--max-autotune]
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --dry   # any machine: every code path, toy shapes

1. Products y = x @ W.T at 1, 2 and 4 rows for Llama-3.2-1B's (bf16, int8 per channel, int4 in
   groups of 32) and SmolLM2-135M's (f16) decode shapes (bench/gpu_kernels_gemv.py): cuBLAS, the
   eager int8 form, Inductor's tuned reduction (torch.compile under coordinate-descent tuning,
   Kiln's default; one row, as at more rows Inductor calls cuBLAS), tinygemm's int4, and Kiln's
   `gemv_kernel` / `gemv_int4_kernel` launched over (BLOCK_N, BLOCK_K, warps, stages): at one row
   every tile the launcher allows, then each shape's best at other warps and stages; at 2 and 4
   rows the autotuner's CONFIGS and the one-row winners. "Kiln today": the fastest of CONFIGS,
   which is what Triton's autotuner picks among.
2. Decode attention, SmolLM2's 9/3 heads and Llama's 32/8 (dim 64), batch 1 and 4, 2048-slot
   caches, positions 127, 511, 2047 (bench/gpu_kernels_attention.py): the fused kernel at every
   chunk, then (block_s, warps) at the best, against the unfused ops under torch.compile.

Times are per launch from CUDA graphs whose launches read their own copies of the inputs (from
memory, as in a decode step: bench/gpu_kernels_timing.py); GB/s = bytes a launch must read /
time. Each section stops starting work when its share of --budget (seconds, compiles included)
has passed, and the report lists what it skipped. --dry runs on the CPU with Triton interpreted
(TRITON_INTERPRET=1, set here before Triton loads), toy shapes, one config each; torch.compile
and tinygemm need the GPU and are skipped there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

if "--dry" in sys.argv:  # Triton reads it when it loads, which importing Kiln's backends may do
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from gpu_kernels_attention import run_attention
from gpu_kernels_gemv import config_of, groups_of, product_items, search_group, time_inductor
from gpu_kernels_timing import Budget

MODELS = {  # name: dtype, hidden, intermediate, heads, kv heads, head dim, vocab, formats
    "llama1b": (torch.bfloat16, 2048, 8192, 32, 8, 64, 128256, ("float", "int8", "int4")),
    "smollm2": (torch.float16, 576, 1536, 9, 3, 64, 49152, ("float",)),
}
TOY_MODELS = {"toy": (torch.bfloat16, 64, 64, 2, 1, 32, 64, ("float", "int8", "int4"))}
LEGEND = """Microseconds per launch, each launch reading its inputs from memory; GB/s: bytes a launch must read
/ time. Products: *default* is what Kiln runs by default (Inductor's reduction at one row for
bf16/f16 and int8, tinygemm for int4; cuBLAS or the eager int8 form where that was not timed),
*Kiln today* the fastest of cuda_gemv.CONFIGS (the autotuner's choices), *Kiln best* the fastest
config timed (BLOCK_NxBLOCK_K, warps, stages), *programs* its output blocks; a ratio above 1x
means Kiln's best is faster. Attention variants: chunk (c-: unsplit), block_s, warps. *error*:
the best config's output against the f32 reference."""
BASELINES = ("cuBLAS", "eager int8", "Inductor", "tinygemm", "max-autotune")  # table order
DEFAULTS = ("Inductor", "tinygemm", "cuBLAS", "eager int8")  # what Kiln runs by default, where timed


def guarded(notes: list, what: str, run) -> None:
    """run(), its failure noted in the report instead of ending the run (one GPU call, no rerun)."""
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the report says what failed; the other items still run
        notes.append(f"{what} failed: {error!r}"[:400])
        print(f"{what} failed: {error!r}", file=sys.stderr, flush=True)


def run_products(items, section, budget, on_gpu: bool, dry: bool, totals, notes, max_autotune=False) -> None:
    """Each compile group in an equal share of what is left of the section's time; at more rows
    seeded with the one-row winners of the same products."""
    winners = {(i["model"], i["format"], i["product"]): i["best"] for i in items if i["rows"] == 1 and i.get("best")}
    groups = groups_of([i for i in items if (i["rows"] == 1) == (section == "one row")])
    for index, group in enumerate(groups):
        if section == "more rows" and budget.past(section):  # one row's groups all run CONFIGS at least
            budget.skip(section, f"{group[0]['model']} {group[0]['format']} K={group[0]['k']} rows {group[0]['rows']}")
            continue
        start = time.perf_counter()
        stop = start + (budget.end_of(section) - start) / (len(groups) - index)
        seeds = [config_of(winners[key]) for key in {(i["model"], i["format"], i["product"]) for i in group}
                 if key in winners]  # fmt: skip
        first = group[0]
        what = f"{first['model']} {first['format']} K={first['k']} rows {first['rows']}"
        guarded(notes, what, functools.partial(search_group, group, stop, on_gpu, dry, seeds, totals, max_autotune))
        for name, error in first.get("failed", {}).items():
            notes.append(f"{what}: config {name} failed: {error}")
        print(f"{what}: {len(first['kiln'])} configs in {time.perf_counter() - start:.1f} s", flush=True)
        if first.get("cut"):
            budget.skip(section, f"{first['cut']} configs of {what}")


def run_inductor(items, budget, on_gpu: bool, totals: dict, notes: list) -> None:
    """Inductor's one-row products, int8 first (the largest loss end to end), then bf16, f16."""
    if not on_gpu:
        notes.append("products: Inductor, max-autotune and tinygemm were not run (no GPU)")
        return
    order = {"int8": 0, "float": 1}
    for item in sorted((i for i in items if i["rows"] == 1 and i["format"] in order), key=lambda i: order[i["format"]]):
        if budget.past("inductor"):
            budget.skip("inductor", f"{item['model']} {item['format']} {item['product']}")
            continue
        what = f"Inductor {item['model']} {item['format']} {item['product']}"
        guarded(notes, what, functools.partial(time_inductor, item, on_gpu, totals))
        print(f"{what}: {item['baselines'].get('Inductor', 0):.1f} us", flush=True)


# -- the report ----------------------------------------------------------------------------------
def row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: list, rows: list) -> list[str]:
    return [row(header), row(["---"] + ["---:"] * (len(header) - 1)), *map(row, rows), ""]


def gbps(nbytes: int, us: float | None) -> str:
    return "-" if not us else f"{nbytes / us / 1e3:.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def product_table(items: list) -> list[str]:
    names = [b for b in BASELINES if any(b in i["baselines"] for i in items)]
    header = ["model", "product", "N x K", "rows", *(f"{n} us" for n in names), "Kiln today us", "Kiln best us"]
    header += ["programs", "default GB/s", "best GB/s", "default / best", "today / best", "configs", "error"]
    rows = []
    for i in items:
        default = next((i["baselines"][b] for b in DEFAULTS if b in i["baselines"]), None)
        today, best = i["kiln"].get(i.get("today")), i["kiln"].get(i.get("best"))
        programs = -(-i["n"] // config_of(i["best"])[0]) if best else "-"
        rows.append([i["model"], i["product"], f"{i['n']} x {i['k']}", i["rows"],
                     *(f"{i['baselines'][n]:.1f}" if n in i["baselines"] else "-" for n in names),
                     f"{today:.1f} ({i['today']})" if today else "-", f"{best:.1f} ({i['best']})" if best else "-",
                     programs, gbps(i["bytes"], default), gbps(i["bytes"], best), ratio(default, best),
                     ratio(today, best), len(i["kiln"]), f"{i.get('kiln error', 0):.1e}"])  # fmt: skip
    return table(header, rows)


def attention_tables(cases: list) -> list[str]:
    header = ["model", "batch", "position", "reference us", "Kiln default us", "Kiln best us", "reference GB/s",
              "best GB/s", "reference / default", "reference / best", "error"]  # fmt: skip
    rows = []
    for c in cases:
        default, best, reference = c["kiln"].get(c["default"]), c["kiln"][c["best"]], c.get("reference")
        rows.append([c["model"], c["batch"], c["position"], f"{reference:.1f}" if reference else "-",
                     f"{default:.1f}", f"{best:.1f} ({c['best']})", gbps(c["bytes"], reference), gbps(c["bytes"], best),
                     ratio(reference, default), ratio(reference, best), f"{c['kiln error']:.1e}"])  # fmt: skip
    chunks = sorted({name.split()[0] for c in cases for name in c["kiln"]}, key=lambda n: (n != "c-", len(n), n))
    sweep = [[c["model"], c["batch"], c["position"],
              *(next((f"{us:.1f}" for n, us in c["kiln"].items() if n == f"{ch} {c['default'].split(' ', 1)[1]}"), "-")
                for ch in chunks)] for c in cases]  # fmt: skip
    return [*table(header, rows), "Kiln's kernel at each chunk (c-: no split), default block_s and warps, us:", "",
            *table(["model", "batch", "position", *chunks], sweep)]  # fmt: skip


def report(meta: dict, items: list, cases: list, totals: dict, notes: list) -> str:
    lines = [f"# Kiln's Triton decode kernels per shape: {meta['device']}", "", meta["line"], "", LEGEND, ""]
    for fmt, title in (("float", "bf16 / f16"), ("int8", "int8 per channel"), ("int4", "int4, groups of 32")):
        chosen = [i for i in items if i["format"] == fmt and i["kiln"]]
        if chosen:
            lines += [f"## Products, {title}", "", *product_table(chosen)]
    if cases:
        lines += ["## Decode attention (reference: the unfused ops under torch.compile)", "", *attention_tables(cases)]
    lines += ["## Run", "", *(f"- {k}: {v:.1f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in totals.items())]
    return "\n".join(lines + [f"- {n}" for n in notes]) + "\n"


def device_meta(on_gpu: bool, budget_s: float) -> dict:
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if not on_gpu:
        return {"device": "CPU (dry run)", "line": f"{versions}; Triton interpreted: times mean nothing"}
    from gpu import copy_bandwidth

    p = torch.cuda.get_device_properties(0)
    line = (f"{p.name}, {p.multi_processor_count} SMs, L2 {p.L2_cache_size >> 20} MB, copy bandwidth "
            f"{copy_bandwidth() / 1e9:.0f} GB/s (read + write), {versions}, --budget {budget_s:.0f} s")  # fmt: skip
    return {"device": p.name, "line": line}


def write(out: Path | None, meta, items, cases, totals, notes) -> str:
    text = report(meta, items, cases, totals, notes)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        data = {"meta": meta, "products": items, "attention": cases, "totals": totals, "notes": notes}
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the Markdown report (and its .json beside it)")
    parser.add_argument(
        "--budget", type=float, default=135.0, help="seconds the run may take after its imports, compiles included"
    )
    parser.add_argument("--max-autotune", action="store_true", help="also bf16/f16 under max-autotune at 2 and 4 rows")
    parser.add_argument("--dry", action="store_true", help="on the CPU, Triton interpreted, toy shapes")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.dry
    if not on_gpu and not args.dry:
        raise SystemExit("gpu_kernels.py times CUDA kernels and sees no GPU here. Fix: run it on a GPU machine "
                         "(bash bench/gpu_run.sh kernels OUT), or check its code paths with --dry.")  # fmt: skip
    torch._dynamo.config.recompile_limit = 64  # one compile per shape of the same function
    torch._inductor.config.compile_threads = 1  # one small graph at a time: no worker pool to start
    budget, totals = Budget(args.budget), {"gemv compile s": 0.0, "gemv configs": 0, "inductor compile s": 0.0}
    totals["attention compile s"] = 0.0
    notes = ["dry run on the CPU: toy shapes, Triton interpreted"] if args.dry else []
    if not args.max_autotune:
        notes.append("max-autotune not run (--max-autotune; at one row it runs Inductor's reduction already)")
    meta = device_meta(on_gpu, args.budget)
    items = product_items(TOY_MODELS if args.dry else MODELS, (1, 2) if args.dry else (1, 2, 4))
    cases: list = []
    sections = [
        lambda: run_products(items, "one row", budget, on_gpu, args.dry, totals, notes),
        lambda: run_inductor(items, budget, on_gpu, totals, notes),
        lambda: cases.extend(run_attention(budget, on_gpu, args.dry, totals, notes)),
        lambda: run_products(items, "more rows", budget, on_gpu, args.dry, totals, notes, args.max_autotune),
    ]
    for section in sections:
        with torch.no_grad():
            section()
        totals["wall s"] = time.perf_counter() - budget.start
        text = write(
            args.out, meta, items, cases, totals, notes + budget.skipped
        )  # after each: a cut run keeps its part
    print(text, flush=True)


if __name__ == "__main__":
    main()
