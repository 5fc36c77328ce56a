"""What the fuse phase does to SmolLM2-135M on the Inductor backend: node counts and speed.

    .venv/bin/python bench/fusion.py [--model DIR] [--threads 2] [--reps 3] [--pp 64] [--tg 64]

Captures the model once, compiles it twice through the default pipeline (fuse phase on, and
off), prints the stateful graphs' node counts per op side by side, then prefill (ppN) and
decode (tgN) tokens/s of the two executables measured in turns, llama-bench style (rows marked
`*` ran while other processes took CPU; see bench.py), and the rate of each one's fastest
decode step, the figure a busy machine disturbs least.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import measure


class GraphRunner:
    """A stateful graph lowered with Inductor (JIT), run through the generation loop."""

    def __init__(self, graph, name: str, threads: int, max_seq_len: int):
        from kiln.backends.executable import BackendOptions
        from kiln.backends.inductor import lower
        from kiln.runtime.generate import LLM

        options = BackendOptions(max_batch=1, max_seq_len=max_seq_len, threads=threads)
        self.llm, self.name = LLM(lower(graph, options)), name

    def prefill(self, n: int):
        tokens, positions = torch.randint(100, 1000, (1, n)), torch.arange(n)[None]
        return lambda: self.llm.executable.run(tokens, positions)

    def generate(self, n: int):
        return lambda: self.llm.generate([1], max_new_tokens=n, ignore_eos=True)

    def fastest_decode_step(self, steps: int) -> float:
        """Seconds of the fastest of `steps` single-token decode calls (after a 16-token prefill):
        on a busy machine the minimum is the least disturbed figure."""
        executable = self.llm.executable
        executable.reset()
        executable.run(torch.randint(100, 1000, (1, 16)), torch.arange(16)[None])
        best = float("inf")
        for position in range(16, 16 + steps):
            started = time.perf_counter()
            executable.run(torch.tensor([[7]]), torch.tensor([[position]]))
            best = min(best, time.perf_counter() - started)
        return best


def op_table(unfused, fused) -> str:
    before, after = Counter(n.op for n in unfused.nodes), Counter(n.op for n in fused.nodes)
    lines = ["| op | unfused | fused |", "| --- | ---: | ---: |"]
    lines += [f"| {op} | {before[op]} | {after[op]} |" for op in sorted(before | after, key=lambda o: -before[o])]
    lines.append(f"| **nodes** | **{len(unfused.nodes)}** | **{len(fused.nodes)}** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--tg", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--counts-only", action="store_true", help="print the node counts, skip the timing")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kiln.backends.executable import BackendOptions
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.frontend.default_model import default_model_dir
    from kiln.passes.pipeline import run_pipeline

    model = load_model(Path(args.model) if args.model else default_model_dir()).model
    options = BackendOptions(max_batch=1, max_seq_len=args.max_seq_len)
    graphs = {
        fuse: run_pipeline(capture_causal_lm(model, 1, args.max_seq_len), options, fuse=fuse) for fuse in (False, True)
    }
    print(op_table(graphs[False], graphs[True]))
    if args.counts_only:
        return 0
    runners = [
        GraphRunner(graphs[fuse], f"kiln-inductor{'' if fuse else '-unfused'}", args.threads, args.max_seq_len)
        for fuse in (False, True)
    ]
    print("\n| backend | test | t/s |\n| --- | --- | ---: |")
    for test, n in (("pp", args.pp), ("tg", args.tg)):
        for row in measure(runners, test, n, args.reps):
            flag = " *" if row["contended"] else ""
            print(f"| {row['backend']} | {row['test']} | {row['mean']:.2f} ± {row['sd']:.2f}{flag} |")
    for runner in runners:
        print(f"| {runner.name} | fastest of 64 decode steps | {1 / runner.fastest_decode_step(64):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
