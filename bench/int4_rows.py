"""int4-g32 linears of a SmolLM2-135M step over M rows of x: `kiln::linear_q4` as built from an
older commit vs as it is now, in one process; or (`--panels`) `kiln::linear_q4` as it is (each
panel staged per call) vs `kiln::linear_q4_panels` (the weights packed into panels once).

    .venv/bin/python bench/int4_rows.py [--m 1,2,4,8,16,32,64] [--repeats 9] [--threads 2]
                                        [--old REV] [--isa vnni|avx2] [--group-size 32]
                                        [--panels [--panels-at-one-row]] [--asymmetric]

Times every linear of one step in order: 30 layers x (qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536), then the lm_head 49152x576; each layer has its own random weights (~75 MB of
codes and f16 scales, as the lowering passes them), so they stream from DRAM as in a real step.
The old column is int4_kernel.cpp (and the headers it includes) from `--old` (default: the
commit before the many-rows kernel), built under the op name `kiln::linear_q4_old`; the two ops
alternate per repeat. Each cell is the median of `--repeats` passes after two warm-up passes,
with its ratio to the same op at M = 1. `--isa avx2` turns AVX-512 VNNI off in both. The CPU time
other processes took during each row is shown (bench/cpu_contention.py); rows where others kept
more than a quarter core busy are repeated up to three times, then flagged `*`.
`--panels-at-one-row` makes linear_q4_panels read the panels at M = 1 too (by default it runs
linear_q4's one-row kernel there); `--asymmetric` gives the weights zero points (f32 scales).
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
        return re.sub(r'"(linear_q4\w*|q4_\w+)(?=[("])', r'"\1_old', text)  # every op it defines

    directory = Path(tempfile.mkdtemp(prefix="kiln_int4_old_"))
    source = at_rev(KERNEL)
    headers = re.findall(r'#include "([^"]+)"', source)
    while headers:  # the headers beside it, and theirs
        header = headers.pop()
        if not (directory / header).exists():
            text = at_rev(str(Path(KERNEL).parent / header))
            (directory / header).write_text(renamed(text))
            headers += re.findall(r'#include "([^"]+)"', text)
    (directory / "int4_kernel.cpp").write_text(renamed(source))
    gemv_kernel.load_extension(directory / "int4_kernel.cpp", "KILN_INT4_KERNELS", "kiln_int4_old", lambda: None)


def make_weights(group_size: int, asymmetric: bool, panels: bool):
    """(qweight, f32 scales, zero points or None, f16 scales or None, panels or None, K) per linear
    of the step, in order."""
    from kiln.backends.inductor.int4_kernel import pack_panels

    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in LAYER_SHAPES * LAYERS + [LM_HEAD]:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = torch.rand(n, k // group_size, generator=gen) * 0.01 + 0.001
        zeros = torch.randint(0, 16, scales.shape, dtype=torch.uint8, generator=gen) if asymmetric else None
        packed = pack_panels(q, scales, zeros, group_size) if panels else None
        out.append((q, scales, zeros, None if asymmetric else scales.half(), packed, k))
    return out


def step_seconds(op, calls, group_size: int) -> float:
    start = time.perf_counter()
    for x, q, scales, zeros, half, _packed in calls:
        op(x, q, scales, zeros, None, group_size, half)
    return time.perf_counter() - start


def panels_step_seconds(calls, group_size: int) -> float:
    start = time.perf_counter()
    for x, q, scales, zeros, half, packed in calls:
        torch.ops.kiln.linear_q4_panels(x, packed, q, scales, zeros, None, group_size, half)
    return time.perf_counter() - start


def time_row(m: int, weights, repeats: int, group_size: int, panels: bool) -> tuple[float, float, float]:
    """Median seconds of one step for the old and the new op at M = m, and others' cores."""
    gen = torch.Generator().manual_seed(m)
    xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
    calls = [(xs[k], *weight[:-1]) for weight in weights for k in [weight[-1]]]
    if panels:
        return paired_medians(
            lambda: step_seconds(torch.ops.kiln.linear_q4, calls, group_size),
            lambda: panels_step_seconds(calls, group_size),
            repeats,
        )
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
    ap.add_argument("--panels", action="store_true", help="linear_q4 (old) vs linear_q4_panels (new)")
    ap.add_argument("--panels-at-one-row", action="store_true")
    ap.add_argument("--asymmetric", action="store_true")
    args = ap.parse_args()
    from kiln.backends.inductor import int4_kernel

    int4_kernel.ensure_loaded()
    torch.set_num_threads(args.threads)
    wanted = args.isa == "vnni"
    isa = "vnni" if torch.ops.kiln.q4_use_vnni(wanted) else "avx2"
    if args.panels:
        torch.ops.kiln.q4_panels_at_one_row(args.panels_at_one_row)
        old = "linear_q4 (staged)"
    else:
        build_old_op(args.old)
        torch.ops.kiln.q4_use_vnni_old(wanted)
        old = args.old
    weights = make_weights(args.group_size, args.asymmetric, args.panels)
    scales = "f32 scales, zero points" if args.asymmetric else "f16 scales"
    print(
        f"SmolLM2-135M int4-g{args.group_size} linears ({len(weights)} calls, {scales}), {args.threads} "
        f"threads, {isa}, old = {old}, median of {args.repeats}"
    )
    print_paired_rows(
        (int(v) for v in args.m.split(",")),
        lambda m: time_row(m, weights, args.repeats, args.group_size, args.panels),
    )


if __name__ == "__main__":
    main()
