"""Continuous-batching throughput on SmolLM2-135M: total tokens/s at 1, 4, 8 and 16 concurrent requests.

    .venv/bin/python bench/throughput.py [--backend onnxruntime] [--concurrency 1,4,8,16] [--requests 16]
        [--new-tokens 32] [--threads 2] [--kv-layout paged --kv-blocks N --max-seq-len 2048 --mix long]
        [--mix decode --max-seq-len 512]

Each level submits `--requests` requests of mixed prompt lengths (16-120 tokens) to one engine
through `llm.submit` from client threads (the engine runs in the main thread, as in `kiln serve`),
at most `concurrency` in flight at a time (a new one as soon as one ends), every request
generating exactly `--new-tokens` tokens (EOS ignored). The artifact is compiled with max_batch
equal to the highest level. Reported per level: total generated tokens/s (wall),
requests/s, mean TTFT, per-request decode tokens/s, the KV cache's bytes (allocated by the
artifact; for a paged cache also the most blocks in use at once), whether every request's tokens
equal the first level's (run one at a time, so each request alone), and the CPU time other
processes took (runs where they took more than a quarter core are flagged `*`); then where each
level's wall time went: decode calls over all its rows, over fewer (while the rows fill and
drain), prompt calls, and the rest (the engine's Python around the calls).

`--kv-layout paged` compiles the cache as a pool of `--kv-blocks` blocks of 32 tokens; `--mix long`
gives requests of mean 300 tokens (prompt and new), one in 16 of 2,048 (the paged cache's gate:
64 of them at once in the memory static rows need for 16 x 2,048). `--static-rows N` adds, in the
same run, the static layout with N rows (the same KV bytes as the pool when N x max_seq_len
slots equal it) serving the same requests N at a time (`--static-concurrency 1,16`: at those levels).
`--mix decode` is decode-heavy: prompts of 8-32 tokens, each request generating its own 128-256
new tokens (seeded; `--new-tokens` is ignored), so nearly every step is a batched decode step
(needs `--max-seq-len` of at least 288). The default mix ("short", 16-120 prompt tokens + 32 new)
is mostly prompt: prefill is compute-bound and batches little.
`--quantize SCHEME` compiles quantized weights (the lm_head and embedding too); `--kv-cache int8`
an int8 KV cache (Inductor).
Writes bench/results/throughput-BACKEND[-paged][-SCHEME][-kv8][-decode].md.
"""

from __future__ import annotations

import argparse
import os
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
    """Mixed-length prompts cut from the bundled Moby-Dick chapters: 16-120 tokens ("short"),
    8-32 tokens ("decode"), or ("long") one in 16 filling `total` tokens with its new ones and the
    rest 64-240 tokens (with 32 new tokens: a mean of ~300 tokens a request)."""
    from kiln.moby_dick import calibration_text

    ids = tokenizer.encode(calibration_text())
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if mix == "long":
            length = total - new if i % 16 == 7 else rng.randint(64, 240)
        elif mix == "decode":
            length = rng.randint(8, 32)
        else:
            length = rng.randint(16, 120)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def new_token_counts(count: int, mix: str, new: int, seed: int = 0) -> list[int]:
    """Tokens each request generates: 128-256 apiece for the decode-heavy mix, else `new` each."""
    if mix != "decode":
        return [new] * count
    rng = random.Random(seed + 1)
    return [rng.randint(128, 256) for _ in range(count)]


def kv_bytes(llm) -> int:
    return sum(view.numel() * view.element_size() for view in llm.executable.cache_views())


def above_engine_priority() -> None:
    """Run the calling thread one step above the process's real-time priority, if it has one."""
    policy = os.sched_getscheduler(0)
    if policy in (os.SCHED_FIFO, os.SCHED_RR):
        priority = os.sched_getparam(0).sched_priority
        os.sched_setscheduler(threading.get_native_id(), policy, os.sched_param(priority + 1))


class CallTimes:
    """Where a level's wall time goes: the executable's calls, timed as the engine makes them, by
    kind (prompt: a call over more than one token; decode: one token per row, over all `full`
    rows or fewer), while installed over `executable.run`."""

    def __init__(self, executable, full: int):
        self.executable, self.full = executable, full
        self.seconds = {"prompt": 0.0, "decode_full": 0.0, "decode_fewer": 0.0}
        self.calls = dict.fromkeys(self.seconds, 0)

    def __enter__(self):
        run = self.executable.run
        self._own = vars(self.executable).get("run")  # an executable may keep run per instance

        def timed(tokens, positions, **keywords):
            start = time.perf_counter()
            out = run(tokens, positions, **keywords)
            rows, width = tokens.shape
            kind = "prompt" if width > 1 else "decode_full" if rows >= self.full else "decode_fewer"
            self.seconds[kind] += time.perf_counter() - start
            self.calls[kind] += 1
            return out

        self.executable.run = timed
        return self

    def __exit__(self, *exc):
        if self._own is None:
            del self.executable.run  # the class's method again
        else:
            self.executable.run = self._own


def run_level(llm, requests: list[list[int]], concurrency: int, new_tokens: list[int]) -> dict:
    """Submit every request from client threads, at most `concurrency` in flight, while the
    engine runs in this (main) thread as `kiln serve` runs it; the level's measurements."""
    handles, stop = [None] * len(requests), threading.Event()
    order, taking = iter(range(len(requests))), threading.Lock()

    def worker():
        # `concurrency` workers, each submitting the next request (in order) once its last one
        # ends, one real-time priority step above the engine under `chrt -f`: a client at the
        # engine's priority waited for a core until the engine's OpenMP threads slept, which they
        # hardly do between steps (a finished request was replaced 0.1-6 s late, so levels 4 and 8
        # ran rows short). They block on the request's end alone, not on every streamed token.
        above_engine_priority()
        while True:
            with taking:
                i = next(order, None)
                if i is None:
                    return
                handles[i] = llm.submit(requests[i], max_new_tokens=new_tokens[i], ignore_eos=True)
            handles[i].result()

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]

    def client():
        for thread in workers:
            thread.join()
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
    with CpuMeter() as meter, CallTimes(llm.executable, concurrency) as calls:
        for thread in workers:  # before the engine runs: a thread's start waits for the GIL
            thread.start()
        threading.Thread(target=client, daemon=True).start()
        if engine.paged:  # a static cache has no blocks to watch: no poller taking the GIL beside the engine
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
        "calls": calls.calls,
        "call_s": calls.seconds,
        "wall_s": wall,
        "outputs": [r.token_ids for r in results],  # in the requests' order (submitted so)
    }


def where_the_time_went(rows: list[dict]) -> list[str]:
    """Each level's wall time split into the model calls by kind and the rest (the engine's Python
    around the calls: sampling, bookkeeping, handing text to the clients)."""
    lines = [
        "",
        "Where the wall time went (s and share; decode calls over every row of the level or fewer, "
        "while the rows fill and drain; prompt calls of a request's prompt):",
        "",
        "| layout | concurrent | wall s | decode, all rows | decode, fewer rows | prompt calls | outside the calls |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        wall, seconds, calls = r["wall_s"], r["call_s"], r["calls"]
        kinds = ("decode_full", "decode_fewer", "prompt")
        cells = [f"{seconds[k]:.1f} ({seconds[k] / wall:.0%}, {calls[k]} calls)" for k in kinds]
        outside = wall - sum(seconds.values())
        cells.append(f"{outside:.1f} ({outside / wall:.0%})")
        lines.append(f"| {r['layout']} | {r['concurrency']} | {wall:.1f} | {' | '.join(cells)} |")
    return lines


def pool_line(paged: dict) -> str:
    """The pool as the artifact holds it (the block count chosen at compile when not given)."""
    return f", {paged['num_blocks']} blocks of {paged['block_size']}"


def compiled(
    backend: str, max_batch: int, max_seq_len: int, kv_layout="static", kv_blocks=None, quantize=None, kv_cache="f32"
):
    import kiln

    layout = f"-paged{kv_blocks}" if kv_layout == "paged" else ""
    scheme = f"-{quantize}" if quantize else ""
    scheme += "-kv8" if kv_cache == "int8" else ""
    out = Path(f"out/bench-throughput-{backend}-b{max_batch}-s{max_seq_len}{layout}{scheme}.kiln")
    if max_seq_len == 256 and not layout and not scheme:
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
            quantize=quantize,
            quantize_embeddings=bool(quantize),
            kv_cache=kv_cache,
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
    parser.add_argument("--kv-cache", default="f32", choices=("f32", "int8"), help="the KV cache's numbers")
    parser.add_argument("--kv-blocks", type=int, default=None, help="the paged pool's blocks of 32 tokens")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--mix", default="short", choices=("short", "long", "decode"))
    parser.add_argument("--quantize", help="weight scheme (int8, int4-g32, ...; lm_head and embedding too)")
    parser.add_argument("--static-rows", type=int, default=0, help="also run the static layout with N rows")
    parser.add_argument(
        "--static-concurrency", default=None, help="the static layout's levels (default: N, its rows, at once)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    llm = compiled(
        args.backend, max(levels), args.max_seq_len, args.kv_layout, args.kv_blocks, args.quantize, args.kv_cache
    )
    runs = [(args.kv_layout, llm, levels)]
    if args.static_rows:
        static = compiled(
            args.backend, args.static_rows, args.max_seq_len, quantize=args.quantize, kv_cache=args.kv_cache
        )
        static_levels = [int(c) for c in (args.static_concurrency or str(args.static_rows)).split(",")]
        runs.append(("static", static, static_levels))  # as many at once as its rows hold, by default
    requests = prompts(llm.tokenizer, args.requests, mix=args.mix, total=args.max_seq_len, new=args.new_tokens)
    new_tokens = new_token_counts(args.requests, args.mix, args.new_tokens)
    if max(len(r) + n for r, n in zip(requests, new_tokens)) > args.max_seq_len:
        parser.error(f"--mix {args.mix} needs --max-seq-len of at least {max(map(len, requests)) + max(new_tokens)}")
    rows = []
    for layout, model, layout_levels in runs:
        model.generate(requests[0][:8], max_new_tokens=4)  # warm-up (first calls of each shape)
        model.generate([r[:40] for r in requests[:4]], max_new_tokens=4)
        for level in layout_levels:
            row = run_level(model, requests, level, new_tokens)
            row["layout"] = layout
            rows.append(row)
            print({k: v for k, v in row.items() if k != "outputs"}, file=sys.stderr)
    alone = rows[0]["outputs"]  # the first level is 1: each request alone
    lengths = [len(r) + n for r, n in zip(requests, new_tokens)]
    news = f"{min(new_tokens)}-{max(new_tokens)}" if min(new_tokens) != max(new_tokens) else f"{new_tokens[0]}"
    lines = [
        f"SmolLM2-135M {args.quantize or 'f32'}, kiln-{args.backend}, {args.threads} threads, "
        f"{args.requests} requests ({args.mix} mix) of "
        f"{min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f}, prompt + {news} new), "
        f"max_seq_len {args.max_seq_len}; {args.kv_layout} {args.kv_cache} KV cache, max_batch {max(levels)}"
        + (pool_line(llm.executable.paged) if args.kv_layout == "paged" else ""),
        "",
        "| layout | concurrent | KV MB | peak blocks | preempted | total tokens/s | x 1 concurrent | requests/s "
        "| mean TTFT ms "
        "| per-request decode tok/s | same as alone | others' cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    single = rows[0]["tokens_per_s"]
    for r in rows:
        flag = " *" if r["contended"] else ""
        same = "yes" if r["outputs"] == alone else "NO"
        peak = r["peak_blocks"] if r["layout"] == "paged" else "-"
        lines.append(
            f"| {r['layout']} | {r['concurrency']} | {r['kv_mb']:.0f} | {peak} | {r['preemptions']} | "
            f"{r['tokens_per_s']:.1f}{flag} | {r['tokens_per_s'] / single:.2f} | "
            f"{r['requests_per_s']:.2f} | {r['ttft_ms']:.0f} | "
            f"{r['decode_tps']:.1f} | {same} | {r['other_cores']:.2f} |"
        )
    lines += where_the_time_went(rows)
    text = "\n".join(lines) + "\n"
    print(text)
    suffix = ("-paged" if args.kv_layout == "paged" else "") + (f"-{args.quantize}" if args.quantize else "")
    suffix += ("-kv8" if args.kv_cache == "int8" else "") + (f"-{args.mix}" if args.mix == "decode" else "")
    write_result(RESULTS / f"throughput-{args.backend}{suffix}.md", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
