"""GPT-2 small decode on the CPU: Kiln's tinygrad backend against a hand-written tinygrad GPT-2, one run.

    .venv/bin/python bench/tinygrad_gpt2.py [--tokens 32] [--reps 3] [--threads 2,1] [--beam 2] [--skip-hf]

The model is GPT-2 small with seeded random weights (bench/gpt2_small.py). Each runner is its
own process, so that Kiln's CPU graph runner (installed into tinygrad's CPU device) never
touches the baseline. All runners load and warm up first, then take turns: rep 1 of each, rep 2
of each, ..., one rep being `--tokens` decoded tokens, so that a burst of load from other
processes lands on every runner alike rather than on whichever ran at the time. The runners:
- tinygrad-handwritten: bench/tinygrad_gpt2_baseline.py, stock tinygrad 0.14, weights as stored;
- tinygrad-handwritten-transposed: the same with nn.Linear's weight layout (what it alone buys);
- kiln-tinygrad: the Kiln artifact compiled with --backend tinygrad, one row per `--threads`
  count (its CPU graph runner splits kernels over that many threads); `--beam N` adds a row with
  tinygrad's BEAM=N kernel search (minutes the first time; cached in ~/.cache/tinygrad);
- hf-eager: PyTorch eager with Hugging Face's KV cache, for reference.
Per rep it prints tokens/s by wall clock and by the runner's own CPU time, and the cores other
processes used meanwhile (`*`: more than a quarter core, see cpu_contention.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_contention import CpuMeter  # noqa: E402
from gpt2_small import gpt2_small_dir  # noqa: E402
from provenance import write_result  # noqa: E402

ARTIFACT = HERE.parent / "out" / "bench-gpt2-small-tinygrad.kiln"
PROMPT = [464, 2068, 7586]


def timed_reps(step, tokens: int, reps: int) -> list[dict]:
    """Run `step()` (one decoded token) tokens times per rep, under a CpuMeter."""
    results = []
    for _ in range(reps):
        cpu = time.process_time()
        with CpuMeter() as meter:
            for _ in range(tokens):
                step()
        cpu = time.process_time() - cpu
        results.append(
            {"tok_s": tokens / meter.result.wall_s, "cpu_tok_s": tokens / cpu, "other_cores": meter.result.other_cores}
        )
    return results


def serve_reps(step, tokens: int) -> None:
    """Child side of the turn-taking: print "ready", then time one rep per "rep" line on stdin."""
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "rep":
            break
        print(json.dumps(timed_reps(step, tokens, 1)[0]), flush=True)


def kiln_child(args) -> None:
    import dataclasses

    import torch

    import kiln
    from kiln.backends import tinygrad as tinygrad_backend

    llm = kiln.load(ARTIFACT)
    options = dataclasses.replace(llm.executable.options, threads=int(args.threads))
    executable = tinygrad_backend.load(ARTIFACT, llm.graph, llm.graph.weights, options)
    logits = executable.run(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None])
    state = {"token": int(logits[0, -1].argmax()), "position": len(PROMPT)}

    def step():
        out = executable.run(torch.tensor([[state["token"]]]), torch.tensor([[state["position"]]]))
        state["token"], state["position"] = int(out[0, -1].argmax()), state["position"] + 1
        if state["position"] >= executable.max_seq_len - 1:
            state["position"] = len(PROMPT)

    for _ in range(3):  # JIT capture (compiles), then replays
        step()
    serve_reps(step, args.tokens)


def hf_child(args) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(int(args.threads))
    model = GPT2LMHeadModel.from_pretrained(gpt2_small_dir()).eval()
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), use_cache=True)
    state = {"past": out.past_key_values, "token": int(out.logits[0, -1].argmax())}

    def step():
        with torch.no_grad():
            out = model(torch.tensor([[state["token"]]]), past_key_values=state["past"], use_cache=True)
        state["past"], state["token"] = out.past_key_values, int(out.logits[0, -1].argmax())

    for _ in range(3):
        step()
    serve_reps(step, args.tokens)


class Runner:
    """One runner's child process, loaded and warmed up, timing a rep when asked."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None):
        self.name, self.reps = name, []
        self.process = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._expect("ready")

    def _expect(self, what: str) -> str:
        for line in self.process.stdout:
            if line.startswith("{") or line.strip() == what:
                return line
        raise RuntimeError(f"{self.name} failed:\n{self.process.stderr.read()[-3000:]}")

    def rep(self) -> dict:
        self.process.stdin.write("rep\n")
        self.process.stdin.flush()
        result = json.loads(self._expect("{"))
        print(f"{self.name}: {result}", file=sys.stderr)
        self.reps.append(result)
        return result

    def close(self) -> dict:
        self.process.stdin.close()
        self.process.wait()
        return {"backend": self.name, "reps": self.reps}


def take_turns(runners: list[Runner], reps: int) -> list[dict]:
    """Rep 1 of every runner, then rep 2 of every runner, ...; the rows in runner order."""
    try:
        for _ in range(reps):
            for runner in runners:
                runner.rep()
    finally:
        rows = [runner.close() for runner in runners]
    return rows


def summary(row: dict, key: str) -> str:
    values = [r[key] for r in row["reps"]]
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {sd:.2f}"


def table(rows: list[dict], tokens: int) -> str:
    lines = [
        "| model | backend | threads | test | t/s (wall) | t/s (own CPU time) | others' cores |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        others = max(r["other_cores"] for r in row["reps"])
        flag = " *" if others > 0.25 else ""
        lines.append(
            f"| GPT-2 small f32 | {row['backend']} | {row['threads']} | tg{tokens} | {summary(row, 'tok_s')}{flag} | "
            f"{summary(row, 'cpu_tok_s')} | {others:.2f} |"
        )
    base = next((r for r in rows if r["backend"] == "tinygrad-handwritten"), None)
    if base:
        mean = lambda row, key: statistics.mean(r[key] for r in row["reps"])  # noqa: E731
        for row in rows:
            if row["backend"].startswith("kiln"):
                wall, cpu = mean(row, "tok_s") / mean(base, "tok_s"), mean(row, "cpu_tok_s") / mean(base, "cpu_tok_s")
                lines.append(
                    f"\n{row['backend']} ({row['threads']} threads): {wall:.1f}x the hand-written "
                    f"baseline by wall clock, {cpu:.1f}x by CPU time"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", default="2,1", help="Kiln-tinygrad rows: comma-separated thread counts")
    parser.add_argument("--beam", type=int, default=0, help="also run Kiln-tinygrad with tinygrad's BEAM=N")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--child", choices=["kiln", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        (kiln_child if args.child == "kiln" else hf_child)(args)
        return 0
    model_dir = gpt2_small_dir()
    if not (ARTIFACT / "manifest.json").exists():
        import kiln

        kiln.compile(str(model_dir), out=ARTIFACT, backend="tinygrad", max_seq_len=256, max_batch=1)
    common = ["--tokens", str(args.tokens)]
    baseline = [str(HERE / "tinygrad_gpt2_baseline.py"), "--tokens", str(args.tokens), "--serve"]
    specs = [
        ("tinygrad-handwritten", "stock", baseline, None),
        ("tinygrad-handwritten-transposed", "stock", baseline + ["--transpose"], None),
    ]
    thread_counts = [int(t) for t in str(args.threads).split(",")]
    for threads in thread_counts:
        kiln_argv = [__file__, "--child", "kiln", *common, "--threads", str(threads)]
        specs.append(("kiln-tinygrad", threads, kiln_argv, None))
        if args.beam:
            specs.append((f"kiln-tinygrad BEAM={args.beam}", threads, kiln_argv, {"BEAM": str(args.beam)}))
    if not args.skip_hf:
        specs.append(
            (
                "hf-eager",
                max(thread_counts),
                [__file__, "--child", "hf", *common, "--threads", str(max(thread_counts))],
                None,
            )
        )
    runners = []
    try:
        for name, _, argv, env in specs:  # one at a time: loading and compiling would contend
            runners.append(Runner(name, argv, env))
    except Exception:
        for runner in runners:
            runner.close()
        raise
    rows = [{**row, "threads": threads} for row, (_, threads, _, _) in zip(take_turns(runners, args.reps), specs)]
    report = table(rows, args.tokens)
    print(report)
    write_result(HERE / "results" / "tinygrad_gpt2.md", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
