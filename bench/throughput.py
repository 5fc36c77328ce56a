"""Continuous-batching throughput on SmolLM2-135M: total tokens/s at 1, 4, 8 and 16 concurrent requests.

    .venv/bin/python bench/throughput.py [--backend onnxruntime] [--concurrency 1,4,8,16] [--requests 16]
        [--new-tokens 32] [--threads 2]

Each level submits `--requests` requests of mixed prompt lengths (16-120 tokens) to one engine
through `llm.submit` from a client thread (the engine runs in the main thread, as in `kiln serve`),
at most `concurrency` in flight at a time (a new one as soon as one ends), every request
generating exactly `--new-tokens` tokens (EOS ignored). The artifact is compiled with max_batch
equal to the highest level. Reported per level: total generated tokens/s (wall),
requests/s, mean TTFT, per-request decode tokens/s, and the CPU time other processes took
(runs where they took more than a quarter core are flagged `*`). Writes bench/results/throughput-BACKEND.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from provenance import write_result

RESULTS = Path(__file__).parent / "results"


def prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """Mixed-length prompts cut from the bundled Moby-Dick chapters."""
    from kiln.moby_dick import calibration_text

    ids = tokenizer.encode(calibration_text())
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(16, 120)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def run_level(llm, requests: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    """Submit every request from a client thread, at most `concurrency` in flight, while the
    engine runs in this (main) thread as `kiln serve` runs it; the level's measurements."""
    gate = threading.Semaphore(concurrency)
    handles, stop = [], threading.Event()

    def release_when_done(handle):
        handle.result()
        gate.release()

    def client():
        for prompt in requests:
            gate.acquire()
            handle = llm.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True)
            handles.append(handle)
            threading.Thread(target=release_when_done, args=(handle,), daemon=True).start()
        for handle in handles:
            handle.result()
        stop.set()

    llm.engine.adopt_this_thread()
    with CpuMeter() as meter:
        threading.Thread(target=client, daemon=True).start()
        llm.engine.run_in_this_thread(stop)
        results = [h.result() for h in handles]
    wall = meter.result.wall_s
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(results) / wall,
        "ttft_ms": 1000 * statistics.mean(r.stats.ttft_s for r in results),
        "decode_tps": statistics.mean(r.stats.decode_tokens_per_s for r in results),
        "other_cores": meter.result.other_cores,
        "contended": meter.result.contended,
    }


def compiled(backend: str, max_batch: int, max_seq_len: int):
    import kiln

    out = Path(f"out/bench-throughput-{backend}-b{max_batch}.kiln")
    if not (out / "manifest.json").exists():
        kiln.compile(None, out=out, backend=backend, max_seq_len=max_seq_len, max_batch=max_batch)
    return kiln.load(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    llm = compiled(args.backend, max(levels), max_seq_len=256)
    requests = prompts(llm.tokenizer, args.requests)
    llm.generate(requests[0][:8], max_new_tokens=4)  # warm-up (first calls of each shape)
    llm.generate(requests[:4], max_new_tokens=4)
    rows = []
    for level in levels:
        row = run_level(llm, requests, level, args.new_tokens)
        rows.append(row)
        print(row, file=sys.stderr)
    lines = [
        f"SmolLM2-135M f32, kiln-{args.backend}, {args.threads} threads, {args.requests} requests of "
        f"16-120 prompt tokens + {args.new_tokens} new tokens each, max_batch {max(levels)}",
        "",
        "| concurrent | total tokens/s | requests/s | mean TTFT ms | per-request decode tok/s | others' cores |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        flag = " *" if r["contended"] else ""
        lines.append(
            f"| {r['concurrency']} | {r['tokens_per_s']:.1f}{flag} | {r['requests_per_s']:.2f} | "
            f"{r['ttft_ms']:.0f} | {r['decode_tps']:.1f} | {r['other_cores']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    write_result(RESULTS / f"throughput-{args.backend}.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
