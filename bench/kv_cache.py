"""The int8 KV cache against the f32 one on SmolLM2-135M (Inductor): quality, speed, bytes.

    chrt -f 10 .venv/bin/python bench/kv_cache.py [--context 2000] [--tokens 32] [--rounds 5]
                                                  [--windows 4] [--decode-windows 1]

The model is captured once (max_seq_len 2048, batch 1); each cache kind runs the pass pipeline
and Inductor lowers it. Both executables stay loaded, so every measure compares them in the
same process:
- perplexity on Moby-Dick chapters 41-42 (kiln/moby_dick.py; as bench/quantization.py), the
  first `--windows` windows of 512 tokens, each one prefill from position 0 (the prefill reads
  the keys it just wrote, quantized); `--decode-windows` of them also one token at a time
  (Kiln's few-queries kernel over the cache);
- decode tokens/s at a `--context`-token context: the text prefilled once, then `--tokens`
  greedy steps from there, repeated `--rounds` times, f32 and int8 in turn (each round rewrites
  the same slots); the median round, and the cores other processes kept busy meanwhile;
- the KV bytes each token takes in the cache (all layers, one row).
Writes bench/results/kv-cache.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
RESULTS = Path(__file__).parent / "results" / "kv-cache.md"
KINDS = ("f32", "int8")


def lowered(captured, kind: str, max_seq_len: int, threads: int):
    from kiln.backends.executable import BackendOptions
    from kiln.backends.inductor import lower
    from kiln.passes.pipeline import run_pipeline
    from quantization import copy_graph

    options = BackendOptions(max_batch=1, max_seq_len=max_seq_len, threads=threads, kv_cache=kind)
    return lower(run_pipeline(copy_graph(captured), options), options)


def kv_bytes_per_token(executable) -> int:
    """Bytes of one slot of one row, summed over every cache buffer (codes and scales)."""
    return sum(view[0, :, 0].numel() * view.element_size() for view in executable.cache_views())


def decode_round(executable, context: torch.Tensor, steps: int) -> float:
    """Seconds of `steps` greedy decode steps after `context` (already in the cache)."""
    token, position = context[-1:].view(1, 1), len(context) - 1
    started = time.perf_counter()
    with torch.no_grad():
        for step in range(steps):
            logits = executable.run(token, torch.tensor([[position + step]]))
            token = logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - started


def decode_speeds(executables: dict, context: torch.Tensor, steps: int, rounds: int) -> tuple[dict, float]:
    """Median tokens/s per kind (rounds alternated) and the others' cores during them."""
    from cpu_contention import CpuMeter

    for executable in executables.values():  # the context, then one warm-up round each
        executable.reset()
        with torch.no_grad():
            executable.run(context[None, :-1], torch.arange(len(context) - 1)[None])
        decode_round(executable, context, 2)
    seconds = {kind: [] for kind in executables}
    with CpuMeter() as meter:
        for _ in range(rounds):
            for kind, executable in executables.items():
                seconds[kind].append(decode_round(executable, context, steps))
    return {kind: steps / statistics.median(s) for kind, s in seconds.items()}, meter.result.other_cores


def report(args, quality: dict, speeds: dict, others: float, sizes: dict) -> str:
    lines = [
        f"SmolLM2-135M-Instruct, Inductor, {args.threads} threads, max_seq_len {args.max_seq_len}, batch 1.",
        "",
        f"Perplexity: Moby-Dick chapters 41-42, {args.windows} windows of 512 tokens, each one prefill "
        f"(decode path: {args.decode_windows} window(s) one token at a time).",
        "",
        "| KV cache | perplexity (prefill) | vs f32 | perplexity (decode path) | vs f32 | KV bytes per token |",
        "|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        q = quality[kind]
        rel = (q["prefill"] / quality["f32"]["prefill"] - 1) * 100
        rel_decode = (q["decode"] / quality["f32"]["decode"] - 1) * 100 if q.get("decode") else None
        decode = f"{q['decode']:.4f} | {rel_decode:+.3f}%" if rel_decode is not None else "- | -"
        lines.append(f"| {kind} | {q['prefill']:.4f} | {rel:+.3f}% | {decode} | {sizes[kind]:,} |")
    lines += [
        "",
        f"Decode at a {args.context}-token context: {args.tokens} greedy steps per round, {args.rounds} rounds, "
        f"f32 and int8 in turn; median round. Others' cores during the rounds: {others:.2f}"
        + (" (contended)" if others > 0.25 else "")
        + ".",
        "",
        "| KV cache | tokens/s | vs f32 |",
        "|---|---|---|",
    ]
    lines += [f"| {kind} | {speeds[kind]:.2f} | {speeds[kind] / speeds['f32']:.3f}x |" for kind in KINDS]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--decode-windows", type=int, default=1)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.frontend.default_model import default_model_dir
    from kiln.moby_dick import evaluation_text
    from kiln.runtime.perplexity import perplexity, token_windows
    from kiln.runtime.tokenizer import Tokenizer
    from provenance import write_result

    model_dir = default_model_dir()
    ids = Tokenizer.from_dir(model_dir).encode(evaluation_text(), add_special_tokens=False)
    windows = token_windows(ids, 512, args.windows)
    context = torch.tensor(ids[: args.context], dtype=torch.int64)
    if len(context) < args.context:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --context {args.context}")
    captured = capture_causal_lm(load_model(model_dir).model, max_batch=1, max_seq_len=args.max_seq_len)
    executables, quality, sizes = {}, {}, {}
    for kind in KINDS:
        started = time.perf_counter()
        executables[kind] = executable = lowered(captured, kind, args.max_seq_len, args.threads)
        quality[kind] = {"prefill": perplexity(executable, windows).perplexity}
        if args.decode_windows:
            quality[kind]["decode"] = perplexity(executable, windows[: args.decode_windows], chunk=1).perplexity
        sizes[kind] = kv_bytes_per_token(executable)
        print(f"{kind}: {quality[kind]} in {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    speeds, others = decode_speeds(executables, context, args.tokens, args.rounds)
    text = report(args, quality, speeds, others, sizes)
    print(text)
    write_result(RESULTS, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
