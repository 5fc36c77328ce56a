"""int4-g32 linears of a SmolLM2-135M step over M rows of x: `kiln::linear_q4` as built from an
older commit vs as it is now, in one process.

    .venv/bin/python bench/int4_rows.py [--m 1,2,4,8,16,32,64] [--repeats 9] [--threads 2]
                                        [--old REV] [--isa vnni|avx2] [--group-size 32]

Times every linear of one step in order: 30 layers x (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536), then the lm_head 49152x576; each layer has its own random weights (~75 MB of
codes and f16 scales, as the lowering passes them), so they stream from DRAM as in a real step.
The old column is int4_kernel.cpp (and the headers it includes) from `--old` (default: the
commit before the many-rows kernel), built under the op name `kiln::linear_q4_old`; the two ops
alternate per repeat. Each cell is the median of `--repeats` passes after two warm-up passes,
with its ratio to the same op at M = 1. `--isa avx2` turns AVX-512 VNNI off in both. The CPU time
other processes took during each row is shown (bench/cpu_contention.py); rows where others kept
more than a quarter core busy are repeated up to three times, then flagged `*`.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import paired_medians, print_paired_rows

REPO = Path(__file__).resolve().parent.parent
KERNEL = "backends/inductor/int4_kernel.cpp"
OLD_REV = "4f6f8fb"  # two rows of x at a time, re-reading the weights per pair
LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down
LM_HEAD = (49152, 576)


def build_old_op(rev: str) -> None:
    """Build int4_kernel.cpp as of `rev` with its names suffixed `_old`/`old` and load it."""
    from kiln.backends.inductor import gemv_kernel

    def at_rev(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout

    def renamed(text: str) -> str:
        text = text.replace("kiln_q4", "kiln_q4old")
        return re.sub(r'"(linear_q4|q4_use_vnni)\b', r'"\1_old', text)

    directory = Path(tempfile.mkdtemp(prefix="kiln_int4_old_"))
    source = at_rev(KERNEL)
    for header in re.findall(r'#include "([^"]+)"', source):
        (directory / header).write_text(renamed(at_rev(str(Path(KERNEL).parent / header))))
    (directory / "int4_kernel.cpp").write_text(renamed(source))
    gemv_kernel.load_extension(directory / "int4_kernel.cpp", "KILN_INT4_KERNELS", "kiln_int4_old", lambda: None)


def make_weights(group_size: int):
    """(qweight, f32 scales, f16 scales, K) per linear of the step, in order."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in LAYER_SHAPES * LAYERS + [LM_HEAD]:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = torch.rand(n, k // group_size, generator=gen) * 0.01 + 0.001
        out.append((q, scales, scales.half(), k))
    return out


def step_seconds(op, calls, group_size: int) -> float:
    start = time.perf_counter()
    for x, q, scales, half in calls:
        op(x, q, scales, None, None, group_size, half)
    return time.perf_counter() - start


def time_row(m: int, weights, repeats: int, group_size: int) -> tuple[float, float, float]:
    """Median seconds of one step for the old and the new op at M = m, and others' cores."""
    gen = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
    calls = [(xs[k], q, scales, half) for q, scales, half, k in weights]
    return paired_medians(
        lambda: step_seconds(torch.ops.kiln.linear_q4_old, calls, group_size),
        lambda: step_seconds(torch.ops.kiln.linear_q4, calls, group_size),
        repeats,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--old", default=OLD_REV, help="git revision of the old kernel")
    ap.add_argument("--isa", choices=("vnni", "avx2"), default="vnni")
    ap.add_argument("--group-size", type=int, default=32)
    args = ap.parse_args()
    from kiln.backends.inductor import int4_kernel

    int4_kernel.ensure_loaded()
    build_old_op(args.old)
    torch.set_num_threads(args.threads)
    wanted = args.isa == "vnni"
    isa = "vnni" if torch.ops.kiln.q4_use_vnni(wanted) else "avx2"
    torch.ops.kiln.q4_use_vnni_old(wanted)
    weights = make_weights(args.group_size)
    print(
        f"SmolLM2-135M int4-g{args.group_size} linears ({len(weights)} calls, f16 scales), {args.threads} "
        f"threads, {isa}, old = {args.old}, median of {args.repeats}"
    )
    print_paired_rows(
        (int(v) for v in args.m.split(",")), lambda m: time_row(m, weights, args.repeats, args.group_size)
    )


if __name__ == "__main__":
    main()
