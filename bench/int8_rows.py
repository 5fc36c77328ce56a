"""int8 linears of a SmolLM2-135M step, old kernel vs new, over M rows of x.

    .venv/bin/python bench/int8_rows.py [--m 1,2,4,8,16,32,64] [--repeats 15] [--threads 2] [--isa vnni|avx2]

Times every int8 linear of one step in order: 30 layers x (qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536), then the lm_head 49152x576; each layer has its own random weights
(~160 MB in all), so they stream from DRAM as in a real step. Columns: `kiln::linear_i8`
(gemv_kernel.py: int8 [K, N] widened to f32) and `kiln::linear_q8` (int8_kernel.py: x rounded
to int8 per block of 32, integer dot products), both in this process, alternating per repeat;
the median of `--repeats` passes, each ratio to its own M = 1. The CPU time other processes
took during each row is shown (bench/cpu_contention.py); rows where others kept more than a
quarter core busy are repeated up to three times, then flagged `*`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import paired_medians, print_paired_rows

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
LM_HEAD = (49152, 576)


def make_weights():
    """One (old, new) weight pair per linear of the step, in order."""
    from kiln.backends.inductor import int8_kernel as ik

    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in LAYER_SHAPES * LAYERS + [LM_HEAD]:
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scales = torch.rand(n, generator=gen) * 0.01 + 0.001
        out.append(((q.t().contiguous(), scales), (ik.pack_int8_weight(q), scales), k))
    return out


def step_seconds(op, calls) -> float:
    start = time.perf_counter()
    for x, w, scales in calls:
        op(x, w, scales, None)
    return time.perf_counter() - start


def time_row(m: int, weights, repeats: int) -> tuple[float, float, float]:
    """Median seconds of one step for the old and the new op at M = m, and others' cores."""
    gen = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
    old = [(xs[k], *w_old) for w_old, _, k in weights]
    new = [(xs[k], *w_new) for _, w_new, k in weights]
    return paired_medians(
        lambda: step_seconds(torch.ops.kiln.linear_i8, old),
        lambda: step_seconds(torch.ops.kiln.linear_q8, new),
        repeats,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=("vnni", "avx2"), default="vnni", help="the new op's kernel")
    args = ap.parse_args()
    from kiln.backends.inductor import gemv_kernel as gk
    from kiln.backends.inductor import int8_kernel as ik

    gk.ensure_loaded()
    ik.ensure_loaded()
    torch.set_num_threads(args.threads)
    isa = "vnni" if torch.ops.kiln.linear_q8_use_vnni(args.isa == "vnni") else "avx2"
    weights = make_weights()
    print(
        f"SmolLM2-135M int8 linears ({len(weights)} calls), {args.threads} threads, new op on {isa}, "
        f"median of {args.repeats}"
    )
    print_paired_rows(
        (int(v) for v in args.m.split(",")), lambda m: time_row(m, weights, args.repeats), "linear_i8", "linear_q8"
    )


if __name__ == "__main__":
    main()
