"""Where the many-row fp32 linears' time goes: bench/many_rows_probe.cpp built and run, a table written.

    python bench/many_rows_probe.py                        # M = 1, 8, 12, 16; the variants at 16
    python bench/many_rows_probe.py --m 16 --rounds 9 --variants kernel,tile48x8
    python bench/many_rows_probe.py --m 1,8,16 --variants kernel,panels --every-m  # the panel kernel beside

The probe times SmolLM2-135M's 121 linears of a step (538 MB fp32) on 2 threads outside torch,
with the project's kernel and with variants of its layout and register tile (see the .cpp), each
checked bit for bit against the kernel: the weights streamed from memory ("cold"), layer 0's
weights again and again (14 MB, in L3) and one core over a 0.66 MB slab (in L2). Rounds of every
variant in turn; medians. Writes bench/results/many-rows-probe.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from provenance import write_result

HERE = Path(__file__).parent
FLAGS = ["-O3", "-fopenmp", "-std=c++20", "-mavx2", "-mfma", "-mf16c", "-w"]  # gemv_kernel.py's kernel flags


def build(out: Path) -> Path:
    binary = out / "many_rows_probe"
    subprocess.run(["g++", *FLAGS, str(HERE / "many_rows_probe.cpp"), "-o", str(binary)], check=True)
    return binary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,8,12,16", help="rows of x")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--variants", default="kernel,slab-steps,tile48x8", help="run at the largest M")
    parser.add_argument("--every-m", action="store_true", help="run the variants at every M, not the largest only")
    parser.add_argument("--out", default="many-rows-probe.md")
    args = parser.parse_args()
    ms = [int(m) for m in args.m.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for m in ms:
            variants = args.variants.split(",") if m == max(ms) or args.every_m else ["kernel"]
            done = subprocess.run([str(binary), str(m), str(args.rounds), *variants], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"many_rows_probe M={m} failed: {done.stdout}{done.stderr}")
            rows += [line.split("|") for line in done.stdout.split("\n") if line.count("|") == 7]
        peak = subprocess.run([str(binary), "0", "3"], capture_output=True, text=True, check=True).stdout.strip()
    lines = [
        "SmolLM2-135M's 121 fp32 linears of a step (538 MB), 2 threads, outside torch; medians of "
        f"{args.rounds} rounds, variants in turn; every variant's outputs equal the kernel's bit for bit "
        "(panels, which adds in k order: within 1e-3).",
        "",
        "| M | variant | cold ms | cold GFLOP/s | cold GB/s | L3-hot ms | L3-hot GFLOP/s | one core, L2-hot GFLOP/s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines += ["", f"{peak} (16 independent AVX-512 FMA chains per thread)."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_result(HERE / "results" / args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
