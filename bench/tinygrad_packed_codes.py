"""tinygrad's quantized decode on packed codes (packed_codes.py) against linear_q's byte layout,
beside Kiln-Inductor, in one run.

    .venv/bin/python bench/tinygrad_packed_codes.py [--artifact out/bench-smollm2] [--scheme int4-g32]
        [--tg 128] [--pp 128] [--reps 3] [--out bench/results/tinygrad-packed-codes.md]

Loads `ARTIFACT-tinygrad-SCHEME.kiln` twice (codes packed into 32-bit words as the backend now
stores them, and, for comparison, linear_q's own byte layout: the plan that packs them is
switched off while that executable is built) and `ARTIFACT-inductor-SCHEME.kiln`, compiled
before by bench/bench.py; times generating `--tg` tokens, taking turns rep by rep, and a prompt
of `--pp` tokens on both tinygrad layouts (last position's logits, as the engine asks). It also times
one SmolLM2-sized product per layout (one row of x, 24 copies of the weight per jitted call).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import KilnRunner, timed
from provenance import write_result

PRODUCTS = [(1536, 576, 24), (576, 1536, 24), (576, 576, 24), (49152, 576, 2)]  # N, K, copies


def byte_layout_runner(artifact: Path, threads: int) -> KilnRunner:
    """The tinygrad artifact loaded with linear_q's byte layout (no packed codes)."""
    from kiln.backends.tinygrad import weight_layouts

    planned = weight_layouts.plan_packed_codes
    weight_layouts.plan_packed_codes = lambda graph, readers: {}
    try:
        runner = KilnRunner(artifact, threads)
    finally:
        weight_layouts.plan_packed_codes = planned
    runner.name += " (byte codes)"
    return runner


def product_seconds(packed: bool, n: int, k: int, copies: int, bits: int, group_size: int) -> float:
    """Seconds per product x @ W.T for one row of x, W [n, k] quantized, in either layout."""
    from tinygrad import Context, Tensor, TinyJit

    from kiln.backends.tinygrad import packed_codes, quantized_lowerings
    from kiln.passes.round_to_nearest import quantize_weight

    torch.manual_seed(0)
    q = quantize_weight(torch.randn(n, k), bits, group_size, True)
    if packed:
        scales = q.scales.reshape(n // 16, 16, -1).transpose(1, 2).contiguous()
        weights, product = [packed_codes.packed_codes(q.qweight, bits), scales.numpy()], packed_codes.packed_product
    else:
        weights, product = [q.qweight.numpy(), q.scales.numpy()], quantized_lowerings.grouped_product
    copies_of = [[Tensor(w).realize() for w in weights] for _ in range(copies)]
    x = Tensor.randn(1, k).realize()
    with Context(PARALLEL=0):  # kernel_opts' hook lives in this process only
        step = TinyJit(
            lambda x: Tensor.realize(*[product(x.contiguous(), *c, None, bits, group_size) for c in copies_of])
        )
        for _ in range(3):
            step(x)
    reps = 30
    start = time.perf_counter()
    for _ in range(reps):
        step(x)
    return (time.perf_counter() - start) / reps / copies


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default="out/bench-smollm2")
    parser.add_argument("--scheme", default="int4-g32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pp", type=int, default=128, help="prompt length for the tinygrad prefill rows (0: none)")
    parser.add_argument("--out", default="bench/results/tinygrad-packed-codes.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kiln.backends.tinygrad.cpu_graph import install_cpu_graph
    from kiln.backends.tinygrad.kernel_opts import install_kernel_opts
    from kiln.backends.tinygrad.toolchain import configure_cpu_device
    from kiln.passes.quant_schemes import get_scheme

    scheme = get_scheme(args.scheme)
    configure_cpu_device("cpu")
    install_cpu_graph(args.threads)
    install_kernel_opts()  # as the executable does: the products' fixed loop optimizations
    lines = ["| N x K | byte codes ms | packed ms | packed GB/s |", "| --- | ---: | ---: | ---: |"]
    for n, k, copies in PRODUCTS:
        old, new = (product_seconds(p, n, k, copies, scheme.bits, scheme.group_size) for p in (False, True))
        nbytes = n * k * scheme.bits / 8 + n * (k // scheme.group_size) * 4
        lines.append(f"| {n} x {k} | {old * 1e3:.3f} | {new * 1e3:.3f} | {nbytes / new / 1e9:.1f} |")
        print(lines[-1], flush=True)
    tinygrad = Path(f"{args.artifact}-tinygrad-{args.scheme}.kiln")
    runners = [
        KilnRunner(tinygrad, args.threads),
        byte_layout_runner(tinygrad, args.threads),
        KilnRunner(Path(f"{args.artifact}-inductor-{args.scheme}.kiln"), args.threads),
    ]
    for runner in runners:
        runner.generate(4)()  # compile the steps' kernels
    rates = {r.name: [] for r in runners}
    contended = {r.name: False for r in runners}
    for _ in range(args.reps):
        for runner in runners:
            seconds, busy, _ = timed(runner.generate(args.tg))
            rates[runner.name].append(args.tg / seconds)
            contended[runner.name] |= busy
    lines += ["", f"| backend | tg{args.tg} t/s |", "| --- | ---: |"]
    for name, values in rates.items():
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"| {name} | {statistics.mean(values):.2f} ± {sd:.2f}{' *' if contended[name] else ''} |")
        print(lines[-1], flush=True)
    if args.pp:
        lines += ["", f"| backend | pp{args.pp} t/s |", "| --- | ---: |"]
        for runner in runners[:2]:
            runner.prefill(args.pp)()  # compile the prefill steps' kernels
            values, busy = [], False
            for _ in range(args.reps):
                seconds, contended_rep, _ = timed(runner.prefill(args.pp))
                values.append(args.pp / seconds)
                busy |= contended_rep
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            lines.append(f"| {runner.name} | {statistics.mean(values):.2f} ± {sd:.2f}{' *' if busy else ''} |")
            print(lines[-1], flush=True)
    lines.append("\n`*`: other processes took more than a quarter core during a rep.")
    write_result(Path(args.out), "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
