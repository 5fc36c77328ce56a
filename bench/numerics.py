"""The numerics gate on SmolLM2-135M: each quantization scheme's KL divergence from f32, beside llama.cpp's.

    .venv/bin/python bench/numerics.py [--schemes int8,int4-g32,...] [--backend onnxruntime] [--quantize-embeddings]
                                       [--windows 4] [--interpreter int4-g64] [--table]

Text and windows are llama-perplexity's: Moby-Dick chapters 41-42 (kiln/moby_dick.py), cut into
windows of 512 tokens (all 19, or the first `--windows`), the second half of each scored (255
tokens each). The model is captured once; f32 through the same backend is the reference, its full
distributions kept in memory (8 bytes per vocabulary entry and token: 400 MB for 4 windows); each
scheme runs the pass pipeline and that backend, and kiln.runtime.quality.compare_many scores it
against the full distributions (exact KLD, llama.cpp's measure) and against their top-k + rest
(what a stored `kiln quality` reference gives), from one run. `--interpreter` schemes also run
through the reference interpreter (the weights' rounding alone, without the backend's kernels,
e.g. ONNX Runtime's int8 activations). Bits per weight (the results' `bytes_per_weight` field):
every stored tensor of the compiled graph (scales, zero points, f32 norms, the embedding) over
the f32 model's parameter count, the way llama.cpp's BPW counts its file.
Results accumulate in bench/results/numerics.json, each row with the command, date and host
that made it; `--table` prints the docs table with bench/results/numerics_llamacpp.json
(bench/numerics_llamacpp.py) beside, sorted by mean KLD.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
RESULTS = Path(__file__).parent / "results" / "numerics.json"
LLAMACPP_RESULTS = Path(__file__).parent / "results" / "numerics_llamacpp.json"
DEFAULT_SCHEMES = "int8,int4-g32,int4-g64,int4-g128,int4-g32-awq,int4-g64-awq,int4-g128-awq"
WINDOW = 512


def bytes_per_weight(graph, parameters: int) -> float:
    return 8 * sum(t.numel() * t.element_size() for t in graph.weights.values()) / parameters


def provenance(argv: list[str]) -> dict:
    """How a row was made: the command, the date and the host (CPU model, cores, load)."""
    cpus = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    host = f"{cpus[0] if cpus else platform.processor()}; {os.cpu_count()} CPUs; loadavg {os.getloadavg()[0]:.1f}"
    return {
        "command": " ".join([f"bench/{Path(sys.argv[0]).name}", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{host}; torch {torch.__version__}",
    }


def record(entry: dict) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    key = ("scheme", "backend", "quantize_embeddings", "mode", "windows")
    results = [r for r in results if tuple(r.get(k) for k in key) != tuple(entry.get(k) for k in key)] + [entry]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def evaluation_windows(tokenizer, count: int | None) -> torch.Tensor:
    from kiln.moby_dick import evaluation_text
    from kiln.runtime.perplexity import token_windows

    ids = tokenizer.encode(evaluation_text(), add_special_tokens=False)
    return token_windows(ids, WINDOW, count or len(ids) // WINDOW)


def measure(args) -> None:
    from kiln.backends.registry import get_backend
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.frontend.default_model import default_model_dir
    from kiln.runtime.quality import compare_many
    from kiln.runtime.reference_logits import reference_logits, truncated
    from kiln.runtime.tokenizer import Tokenizer
    from quantization import compiled_graph, copy_graph

    model_dir = default_model_dir()
    windows = evaluation_windows(Tokenizer.from_dir(model_dir), args.windows)
    loaded = load_model(model_dir)
    captured = capture_causal_lm(loaded.model, max_batch=1, max_seq_len=WINDOW)
    parameters = sum(p.numel() for p in loaded.model.parameters())  # tied embedding counted once
    backend = get_backend(args.backend)

    def lower(scheme: str, quantize_embeddings: bool, on=backend):
        graph, options = compiled_graph(captured, scheme, quantize_embeddings, loaded.tokenizer_path, args.threads)
        return on.lower(copy_graph(graph), options), bytes_per_weight(graph, parameters)

    f32, f32_bpw = lower("none", False)
    full = reference_logits(f32, windows, top_k=None, source=f"SmolLM2-135M f32 {args.backend}")
    references = [full, truncated(full, args.top_k)]  # exact KLD, and what a stored top-k file gives
    level = int(os.environ["KILN_ORT_ACCURACY_LEVEL"]) if args.backend == "onnxruntime" else None
    common = {
        "backend": args.backend,
        "windows": len(windows),
        "window": WINDOW,
        "threads": args.threads,
        "ort_accuracy_level": level,
        **provenance(args.argv),
    }

    def measure_one(entry: dict, executable) -> None:
        results = compare_many(executable, references)
        for mode, result in zip(("exact", "top-k"), results):
            record({**entry, "mode": mode, **result.to_dict()})
        print(f"{entry['scheme']} {entry['backend']}:\n{results[0].summary()}", file=sys.stderr, flush=True)

    measure_one({"scheme": "none", "quantize_embeddings": False, "bytes_per_weight": f32_bpw, **common}, f32)
    del f32
    interpreted = set(args.interpreter.split(",")) - {""}
    for scheme in args.schemes.split(","):
        started = time.perf_counter()
        executable, bpw = lower(scheme, args.quantize_embeddings)
        entry = {"scheme": scheme, "quantize_embeddings": args.quantize_embeddings, "bytes_per_weight": bpw, **common}
        measure_one(entry, executable)
        del executable
        if scheme in interpreted:
            from kiln.backends import reference as interpreter

            executable, _ = lower(scheme, args.quantize_embeddings, interpreter)
            measure_one({**entry, "backend": "reference"}, executable)
            del executable
        gc.collect()
        print(f"{scheme}: {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)


def table(windows: int | None) -> str:
    """The docs table: Kiln's schemes (exact KLD) beside llama.cpp's types, on `windows` windows,
    then where each row comes from (command, date, host) where the results record it."""
    count = windows or 19
    kiln = [
        r
        for r in json.loads(RESULTS.read_text())
        if r["mode"] == "exact" and r["scheme"] != "none" and r["windows"] == count
    ]
    llama = json.loads(LLAMACPP_RESULTS.read_text()) if LLAMACPP_RESULTS.exists() else []
    llama = [r for r in llama if r["windows"] == count]
    lines = [
        "| tool | scheme | lm_head + embedding | windows | bits / weight | mean KLD | median KLD | p99 KLD "
        "| same top | Δp RMS | PPL ratio |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    sources = []
    rows = [("llama.cpp", r["type"], "q8_0", r) for r in llama]
    for r in kiln:
        tool = "Kiln, interpreter" if r["backend"] == "reference" else f"Kiln, {r['backend']}"
        if r.get("ort_accuracy_level") is not None:
            tool += f" (accuracy level {r['ort_accuracy_level']})"
        rows.append((tool, r["scheme"], "quantized" if r["quantize_embeddings"] else "f32", r))
    for tool, scheme, embedding, r in sorted(rows, key=lambda row: row[3]["mean_kld"]):
        lines.append(f"| {tool} | {scheme} | {embedding} | {count} | {r['bytes_per_weight']:.2f} | {_row(r)}")
        if "command" in r:
            sources.append(f"- {tool} {scheme}: `{r['command']}`, {r['date']}, {r['host']}")
    return "\n".join(lines + ([""] + sources if sources else []))


def _row(r: dict) -> str:
    return (
        f"{r['mean_kld']:.5f} ± {r['kld_stderr']:.5f} | {r['median_kld']:.5f} | {r['p99_kld']:.4f} | "
        f"{100 * r['same_top_rate']:.2f} | {100 * r['delta_p_rms']:.2f} | {r['perplexity_ratio']:.4f} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default=DEFAULT_SCHEMES)
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--quantize-embeddings", action="store_true", help="quantize the lm_head and embedding too")
    parser.add_argument("--interpreter", default="", help="schemes also run through the reference interpreter")
    parser.add_argument("--windows", type=int, help="the first N windows (default: all 19; llama.cpp: --chunks N)")
    parser.add_argument("--top-k", type=int, default=256, help="also report the KLD a stored top-k reference gives")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ort-accuracy-level", default="4")
    parser.add_argument("--table", action="store_true", help="only print the table of the recorded results")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if not args.table:
        os.environ["KILN_ORT_ACCURACY_LEVEL"] = args.ort_accuracy_level  # read when the ORT backend is imported
        torch.set_num_threads(args.threads)
        measure(args)
    print(table(args.windows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
