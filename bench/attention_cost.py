"""Kiln's attention kernel alone (`kiln::cached_attention`) against an older copy of its source.

    git show <commit>:backends/inductor/attention_kernel.cpp > /tmp/old/attention_kernel.cpp
    .venv/bin/python bench/attention_cost.py --baseline-source /tmp/old/attention_kernel.cpp

One step's attention of SmolLM2-135M-Instruct (30 layers, 9 query heads, 3 kv heads, head dim 64)
over a row of 2,048 slots, f32 and int8 caches, M query tokens at positions START..START+M-1;
each layer's cache its own tensors, as in a model. The baseline source is built as the op
`kiln_baseline::cached_attention` (its library name rewritten) and the two take turns call by
call; the best of `--repeats` rounds is reported. Writes bench/results/attention_cost.md.

`--rows 16 --row-positions 20-275,150-150` measures a batched decode step instead: 16 rows of one
token each at positions spread evenly over each range (rows of 512 slots; the rows of a range
from 20 to 275 read from 21 to 276 slots each), every layer's cache its own tensors.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kiln.backends.inductor import attention_kernel, gemv_kernel
from kiln.ir.ops.kv_quant import kv_quantize_reference
from provenance import cpu_name, write_result

LAYERS, HEADS, KV_HEADS, HEAD_DIM, SLOTS = 30, 9, 3, 64, 2048


def load_baseline(source: Path, build_dir: Path):
    """The older kernel's source as its own op library (kiln -> kiln_baseline)."""
    text = source.read_text()
    text = text.replace("TORCH_LIBRARY_FRAGMENT(kiln, m)", "TORCH_LIBRARY_FRAGMENT(kiln_baseline, m)")
    text = text.replace("TORCH_LIBRARY_IMPL(kiln, CPU, m)", "TORCH_LIBRARY_IMPL(kiln_baseline, CPU, m)")
    build_dir.mkdir(parents=True, exist_ok=True)
    copy = build_dir / "attention_kernel.cpp"
    copy.write_text(text)
    gemv_kernel.load_extension(copy, "KILN_ATTENTION_KERNELS", "kiln_attention_baseline", lambda: None)
    return torch.ops.kiln_baseline.cached_attention


def caches(int8: bool) -> list[tuple]:
    def one():
        k, v = torch.randn(1, KV_HEADS, SLOTS, HEAD_DIM), torch.randn(1, KV_HEADS, SLOTS, HEAD_DIM)
        if not int8:
            return (k, v)
        (k, k_scales), (v, v_scales) = kv_quantize_reference(k), kv_quantize_reference(v)
        return (k, v, k_scales, v_scales)

    return [one() for _ in range(LAYERS)]


def rows_table(ops: dict, rows: int, ranges: str, repeats: int, threads: int) -> list[str]:
    """A decode step over `rows` rows at positions spread over each range LO-HI, baseline and
    current taking turns call by call."""
    slots = 512
    layers = [
        (torch.randn(rows, KV_HEADS, slots, HEAD_DIM), torch.randn(rows, KV_HEADS, slots, HEAD_DIM))
        for _ in range(LAYERS)
    ]
    q = torch.randn(rows, HEADS, 1, HEAD_DIM)
    lines = [
        f"One decode step's attention over {rows} rows of one token, SmolLM2-135M-Instruct shapes ({LAYERS} "
        f"layers), {threads} threads, {slots}-slot rows, host CPU {cpu_name()}; ms per step, best of {repeats}",
        "",
        "| positions | baseline ms | current ms | speedup |",
        "| --- | ---: | ---: | ---: |",
    ]
    for span in ranges.split(","):
        low, high = (int(p) for p in span.split("-"))
        positions = torch.tensor([low + (high - low) * r // max(1, rows - 1) for r in range(rows)]).view(rows, 1)
        best = best_seconds(ops, q, positions, layers, repeats)
        row = (
            f"| {low}-{high} | {best['baseline'] * 1e3:.2f} | {best['current'] * 1e3:.2f} | "
            f"{best['baseline'] / best['current']:.2f}x |"
        )
        print(row, flush=True)
        lines.append(row)
    return lines


def best_seconds(ops, q, positions, layers, repeats: int) -> dict[str, float]:
    """Each op's best step time over `repeats` rounds, the ops alternating within a round."""
    best = dict.fromkeys(ops, float("inf"))
    for _round in range(repeats):
        for name, op in ops.items():
            best[name] = min(best[name], step_seconds(op, q, positions, layers))
    return best


def step_seconds(op, q, positions, layers) -> float:
    start = time.perf_counter()
    for cache in layers:
        op(q, *cache[:2], positions, HEAD_DIM**-0.5, 0, None, *cache[2:])
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-source", type=Path, required=True, help="an older attention_kernel.cpp")
    parser.add_argument("--m", default="1,8,16")
    parser.add_argument("--starts", default="256,1984", help="the first query token's position")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--rows", type=int, default=0, help="a batched decode step over this many rows instead")
    parser.add_argument("--row-positions", default="20-275,150-150", help="with --rows: ranges the rows spread over")
    parser.add_argument("--build-dir", type=Path, default=Path("out/attention_cost"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_cost.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    attention_kernel.ensure_loaded()
    ops = {"baseline": load_baseline(args.baseline_source, args.build_dir), "current": torch.ops.kiln.cached_attention}
    if args.rows:
        write_result(args.out, "\n".join(rows_table(ops, args.rows, args.row_positions, args.repeats, args.threads)))
        print(f"wrote {args.out}")
        return 0
    lines = [
        f"One step's attention, SmolLM2-135M-Instruct shapes ({LAYERS} layers), {args.threads} threads, "
        f"{SLOTS}-slot rows, host CPU {cpu_name()}; ms per step, best of {args.repeats}",
        "",
        "| cache | first position | M | baseline ms | current ms | speedup |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for int8 in (False, True):
        layers = caches(int8)
        for start in [int(s) for s in args.starts.split(",")]:
            for m in [int(m) for m in args.m.split(",")]:
                q = torch.randn(1, HEADS, m, HEAD_DIM)
                positions = (start + torch.arange(m)).view(1, m)
                best = best_seconds(ops, q, positions, layers, args.repeats)
                row = (
                    f"| {'int8' if int8 else 'f32'} | {start} | {m} | {best['baseline'] * 1e3:.2f} | "
                    f"{best['current'] * 1e3:.2f} | {best['baseline'] / best['current']:.2f}x |"
                )
                print(row, flush=True)
                lines.append(row)
    write_result(args.out, "\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
