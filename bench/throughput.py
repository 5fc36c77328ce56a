"""Continuous-batching throughput on SmolLM2-135M: total tokens/s at 1, 4, 8 and 16 concurrent requests.

    .venv/bin/python bench/throughput.py [--backend onnxruntime] [--concurrency 1,4,8,16] [--requests 16]
        [--new-tokens 32] [--threads 2] [--kv-layout paged --kv-blocks N --max-seq-len 2048 --mix long]

Each level submits `--requests` requests of mixed prompt lengths (16-120 tokens) to one engine
through `llm.submit` from a client thread (the engine runs in the main thread, as in `kiln serve`),
at most `concurrency` in flight at a time (a new one as soon as one ends), every request
generating exactly `--new-tokens` tokens (EOS ignored). The artifact is compiled with max_batch
equal to the highest level. Reported per level: total generated tokens/s (wall),
requests/s, mean TTFT, per-request decode tokens/s, the KV cache's bytes (allocated by the
artifact; for a paged cache also the most blocks in use at once), whether every request's tokens
equal the first level's (run one at a time, so each request alone), and the CPU time other
processes took (runs where they took more than a quarter core are flagged `*`).

`--kv-layout paged` compiles the cache as a pool of `--kv-blocks` blocks of 32 tokens; `--mix long`
gives requests of mean 300 tokens (prompt and new), one in 16 of 2,048 (the paged cache's gate:
64 of them at once in the memory static rows need for 16 x 2,048). `--static-rows N` adds, in the
same run, the static layout with N rows (the same KV bytes as the pool when N x max_seq_len
slots equal it) serving the same requests N at a time.
Writes bench/results/throughput-BACKEND[-paged].md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from provenance import write_result

RESULTS = Path(__file__).parent / "results"


def prompts(tokenizer, count: int, seed: int = 0, mix: str = "short", total: int = 2048, new: int = 32):
    """Mixed-length prompts cut from the bundled Moby-Dick chapters: 16-120 tokens ("short"), or
    ("long") one in 16 filling `total` tokens with its new ones and the rest 64-240 tokens (with
    32 new tokens: a mean of ~300 tokens a request)."""
    from kiln.moby_dick import calibration_text

    ids = tokenizer.encode(calibration_text())
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if mix == "long":
            length = total - new if i % 16 == 7 else rng.randint(64, 240)
        else:
            length = rng.randint(16, 120)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def kv_bytes(llm) -> int:
    return sum(view.numel() * view.element_size() for view in llm.executable.cache_views())


def run_level(llm, requests: list[list[int]], concurrency: int, new_tokens: int) -> dict:
    """Submit every request from a client thread, at most `concurrency` in flight, while the
    engine runs in this (main) thread as `kiln serve` runs it; the level's measurements."""
    handles, stop = [], threading.Event()

    def client():
        # Polls instead of a thread per request: starting a thread waits for it to run, which
        # waits for the engine's model call (a compiled step holds the GIL) to end: one
        # submission per engine step, which kept levels above one from filling.
        for prompt in requests:
            while sum(not h.done for h in handles) >= concurrency:
                time.sleep(0.001)
            handles.append(llm.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True))
        for handle in handles:
            handle.result()
        stop.set()

    engine = llm.engine
    engine.slots.forget()  # no prefix cached by an earlier level
    peak_blocks = [0]

    def watch():
        while not stop.is_set():
            peak_blocks[0] = max(peak_blocks[0], engine.blocks_in_use or 0)
            stop.wait(0.005)

    engine.adopt_this_thread()
    preempted = engine.preemptions
    with CpuMeter() as meter:
        threading.Thread(target=client, daemon=True).start()
        threading.Thread(target=watch, daemon=True).start()
        engine.run_in_this_thread(stop)
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
        "peak_blocks": peak_blocks[0],
        "preemptions": engine.preemptions - preempted,
        "kv_mb": kv_bytes(llm) / 1e6,
        "outputs": [r.token_ids for r in results],  # in the requests' order (submitted so)
    }


def compiled(backend: str, max_batch: int, max_seq_len: int, kv_layout: str = "static", kv_blocks=None):
    import kiln

    layout = f"-paged{kv_blocks}" if kv_layout == "paged" else ""
    out = Path(f"out/bench-throughput-{backend}-b{max_batch}-s{max_seq_len}{layout}.kiln")
    if max_seq_len == 256 and not layout:
        out = Path(f"out/bench-throughput-{backend}-b{max_batch}.kiln")  # the name before the options
    if not (out / "manifest.json").exists():
        kiln.compile(
            None,
            out=out,
            backend=backend,
            max_seq_len=max_seq_len,
            max_batch=max_batch,
            kv_layout=kv_layout,
            kv_blocks=kv_blocks,
        )
    return kiln.load(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-layout", default="static", choices=("static", "paged"))
    parser.add_argument("--kv-blocks", type=int, default=None, help="the paged pool's blocks of 32 tokens")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--mix", default="short", choices=("short", "long"))
    parser.add_argument("--static-rows", type=int, default=0, help="also run the static layout with N rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    llm = compiled(args.backend, max(levels), args.max_seq_len, args.kv_layout, args.kv_blocks)
    runs = [(args.kv_layout, llm, levels)]
    if args.static_rows:
        static = compiled(args.backend, args.static_rows, args.max_seq_len)
        runs.append(("static", static, [args.static_rows]))  # as many at once as its rows hold
    requests = prompts(llm.tokenizer, args.requests, mix=args.mix, total=args.max_seq_len, new=args.new_tokens)
    rows = []
    for layout, model, layout_levels in runs:
        model.generate(requests[0][:8], max_new_tokens=4)  # warm-up (first calls of each shape)
        model.generate([r[:40] for r in requests[:4]], max_new_tokens=4)
        for level in layout_levels:
            row = run_level(model, requests, level, args.new_tokens)
            row["layout"] = layout
            rows.append(row)
            print({k: v for k, v in row.items() if k != "outputs"}, file=sys.stderr)
    alone = rows[0]["outputs"]  # the first level is 1: each request alone
    lengths = [len(r) + args.new_tokens for r in requests]
    lines = [
        f"SmolLM2-135M f32, kiln-{args.backend}, {args.threads} threads, {args.requests} requests of "
        f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}, prompt + {args.new_tokens} new), "
        f"max_seq_len {args.max_seq_len}; {args.kv_layout} KV cache, max_batch {max(levels)}"
        + (f", {args.kv_blocks} blocks of 32" if args.kv_layout == "paged" else ""),
        "",
        "| layout | concurrent | KV MB | peak blocks | preempted | total tokens/s | requests/s | mean TTFT ms "
        "| per-request decode tok/s | same as alone | others' cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        flag = " *" if r["contended"] else ""
        same = "yes" if r["outputs"] == alone else "NO"
        peak = r["peak_blocks"] if r["layout"] == "paged" else "-"
        lines.append(
            f"| {r['layout']} | {r['concurrency']} | {r['kv_mb']:.0f} | {peak} | {r['preemptions']} | "
            f"{r['tokens_per_s']:.1f}{flag} | {r['requests_per_s']:.2f} | {r['ttft_ms']:.0f} | "
            f"{r['decode_tps']:.1f} | {same} | {r['other_cores']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = "-paged" if args.kv_layout == "paged" else ""
    write_result(RESULTS / f"throughput-{args.backend}{suffix}.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
