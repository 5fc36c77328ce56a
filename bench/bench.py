"""Decode and prefill speed of SmolLM2-135M: Kiln beside Hugging Face and onnxruntime-genai, in one run.

    .venv/bin/python bench/bench.py [--model DIR] [--threads 2] [--reps 5] [--skip-hf-compile]
        [--backends inductor,onnxruntime,tinygrad] [--genai fp32,int4 | --genai none] [--quantize int4-g32,int8]
        [--llamacpp f32,q8_0,q4_0]

Prints a llama-bench style table (pp64: prompt processing of 64 tokens; tg128: generating 128
tokens, batch 1) with tokens/s as mean ± sd, the weight bandwidth decode reached, and the
ratios of Kiln to the baselines. Runs during which other processes took more than a quarter
core are repeated (up to 3 times) and flagged with `*` if they stay contended. The repetitions
of a test alternate between runners (kiln, genai, kiln, genai, ...) so that contention that
comes and goes hits them alike. onnxruntime-genai (the `bench` extra) runs the model its own
builder makes from the same checkpoint; llama.cpp (llamacpp_baseline.py) runs llama-bench on the
default model's GGUF requantized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from genai_baseline import GenaiRunner, build_genai_model
from llamacpp_baseline import LlamaCppRunner, quantized_gguf
from provenance import write_result

RESULTS = Path(__file__).parent / "results"
BASELINES = (
    "hf-eager",
    "hf-static+compile",
    "ort-genai-fp32",
    "ort-genai-int4",
    "llama.cpp-f32",
    "llama.cpp-q8_0",
    "llama.cpp-q4_0",
)


def timed(fn, retries: int = 3):
    """Run fn under a CpuMeter; retry while contended. Returns (seconds, contended, others' cores).
    The seconds are the call's wall time, or what fn returns when it times itself (llama-bench)."""
    for _ in range(retries):
        with CpuMeter() as meter:
            own_seconds = fn()
        if not meter.result.contended:
            break
    m = meter.result
    return own_seconds if isinstance(own_seconds, float) else m.wall_s, m.contended, m.other_cores


def compiled_before_sources(artifact: Path) -> bool:
    """Whether Kiln's sources changed since `artifact` was compiled (then it is compiled again:
    a bench must not time what older code made)."""
    if not (artifact / "manifest.json").exists():
        return False  # not compiled yet: the caller compiles it anyway
    root = Path(__file__).resolve().parent.parent
    sources = [f for d in ("kiln", "frontend", "ir", "passes", "backends", "runtime") for f in (root / d).rglob("*.py")]
    return max(f.stat().st_mtime for f in sources) > (artifact / "manifest.json").stat().st_mtime


class KilnRunner:
    def __init__(self, artifact: Path, threads: int):
        import kiln

        self.llm = kiln.load(artifact)
        quantize = self.llm.manifest.get("options", {}).get("quantize")
        embeddings = self.llm.manifest.get("options", {}).get("quantize_embeddings")
        self.name = (
            f"kiln-{self.llm.manifest['backend']}"
            + (f"-{quantize}" if quantize else "")
            + ("-emb" if quantize and embeddings else "")
        )
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.llm.graph.weights.values())
        if self.llm.manifest["backend"] == "onnxruntime":  # its session sizes its own thread pool
            import dataclasses

            from kiln.backends import onnxruntime as ort_backend

            options = dataclasses.replace(self.llm.executable.options, threads=threads)
            self.llm.executable = ort_backend.load(artifact, self.llm.graph, {}, options)
        if self.llm.manifest["backend"] == "tinygrad":  # its CPU graph runner splits kernels over `threads` cores
            import dataclasses

            from kiln.backends import tinygrad as tinygrad_backend

            options = dataclasses.replace(self.llm.executable.options, threads=threads)
            self.llm.executable = tinygrad_backend.load(artifact, self.llm.graph, self.llm.graph.weights, options)

    def prefill(self, n: int):
        """A prompt as the engine feeds it: the last position's logits only, where the backend
        can skip the others (as llama.cpp does; genai and Hugging Face compute all n)."""
        from kiln.backends.executable import capabilities

        tokens = torch.randint(100, 1000, (1, n))
        positions = torch.arange(n)[None]
        last_only = {"last_only": True} if capabilities(self.llm.executable).selects_logits else {}
        return lambda: self.llm.executable.run(tokens, positions, **last_only)

    def generate(self, n: int):
        return lambda: self.llm.generate([1], max_new_tokens=n, ignore_eos=True)


class HFRunner:
    def __init__(self, model_dir: Path, compiled: bool):
        from kiln.frontend.checkpoint import load_model

        self.model = load_model(model_dir).model
        self.name = "hf-static+compile" if compiled else "hf-eager"
        if compiled:
            self.model.generation_config.cache_implementation = "static"
            self.model.forward = torch.compile(self.model.forward, fullgraph=True)

    def prefill(self, n: int):
        tokens = torch.randint(100, 1000, (1, n))

        def run():
            with torch.no_grad():
                self.model(input_ids=tokens, use_cache=False)

        return run

    def generate(self, n: int):
        ids = torch.tensor([[1]])

        def run():
            with torch.no_grad():
                self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

        return run


def measure(runners: list, test: str, n: int, reps: int) -> list[dict]:
    """tokens/s of `reps` timed runs per runner after one warm-up each, the runners taking turns
    rep by rep. tg subtracts a 1-token generate's time."""
    fns = [
        (runner.prefill(n), None) if test == "pp" else (runner.generate(n), runner.generate(1)) for runner in runners
    ]
    for fn, base in fns:
        fn()
        if base:
            base()
    rates = [[] for _ in runners]
    flagged, others = [False] * len(runners), [[] for _ in runners]
    for _ in range(reps):
        for i, (fn, base) in enumerate(fns):
            seconds, contended, other = timed(fn)
            if base:
                base_s, base_contended, _ = timed(base)
                seconds, contended = seconds - base_s, contended or base_contended
                rates[i].append((n - 1) / seconds)
            else:
                rates[i].append(n / seconds)
            flagged[i] |= contended
            others[i].append(other)
    return [
        {
            "backend": runner.name,
            "test": f"{test}{n}",
            "mean": statistics.mean(r),
            "sd": statistics.stdev(r) if len(r) > 1 else 0.0,
            "contended": f,
            "other_cores": max(o),
            "weight_bytes": getattr(runner, "weight_bytes", None),
        }
        for runner, r, f, o in zip(runners, rates, flagged, others)
    ]


def table(rows: list[dict], weight_bytes: int, params: int, threads: int) -> str:
    # size: the weights a decode step reads (f32 unless the backend name says otherwise)
    lines = [
        "| model | size | params | backend | threads | test | t/s | weight GB/s |",
        "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        row_bytes = r.get("weight_bytes") or weight_bytes
        gbs = f"{r['mean'] * row_bytes / 1e9:.1f}" if r["test"].startswith("tg") else ""
        flag = " *" if r["contended"] else ""
        lines.append(
            f"| SmolLM2-135M | {row_bytes / 2**20:.0f} MiB | {params / 1e6:.1f} M | {r['backend']} | "
            f"{threads} | {r['test']} | {r['mean']:.2f} ± {r['sd']:.2f}{flag} | {gbs} |"
        )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    by = {(r["backend"], r["test"]): r["mean"] for r in rows}
    out = []
    for (backend, test), rate in by.items():
        if backend.startswith("kiln"):
            for base in BASELINES:
                if (base, test) in by:
                    out.append(f"{backend} {test}: {rate / by[(base, test)]:.2f}x {base}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF directory (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--artifact", default="out/bench-smollm2", help="artifact path prefix (+ -BACKEND.kiln)")
    parser.add_argument("--backends", default="inductor,onnxruntime,tinygrad", help="Kiln backends, comma-separated")
    parser.add_argument("--genai", default="fp32", help="onnxruntime-genai builder precisions (fp32,int4) or none")
    parser.add_argument(
        "--llamacpp",
        default="none",
        help="llama.cpp types beside Kiln (f32,q8_0,q4_0) or none; "
        "needs `python bench/llamacpp_baseline.py build` first",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument(
        "--quantize",
        default="",
        help="also Kiln artifacts with these weight schemes (e.g. int4-g32,int8), on each backend",
    )
    parser.add_argument(
        "--quantize-embeddings",
        action="store_true",
        help="the --quantize artifacts also quantize the lm_head and token embedding",
    )
    parser.add_argument("--skip-hf-compile", action="store_true", help="skip the slow-to-compile baseline")
    parser.add_argument("--skip-hf", action="store_true", help="skip both Hugging Face baselines")
    parser.add_argument(
        "--reuse-artifacts",
        action="store_true",
        help="load existing artifacts even where Kiln's sources changed since they were compiled (a tinygrad "
        "artifact is the graph and weights, lowered again at load by the current code)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import kiln
    from kiln.frontend.default_model import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    artifacts = []
    schemes = [None] + [q for q in args.quantize.split(",") if q]
    for scheme in schemes:
        for backend in args.backends.split(","):
            embeddings = bool(scheme) and args.quantize_embeddings
            suffix = (f"-{scheme}" if scheme else "") + ("-emb" if embeddings else "")
            artifact = Path(f"{args.artifact}-{backend}{suffix}.kiln")
            stale = not args.reuse_artifacts and compiled_before_sources(artifact)
            if not (artifact / "manifest.json").exists() or stale:
                started = time.perf_counter()
                kiln.compile(
                    str(model_dir),
                    out=artifact,
                    backend=backend,
                    max_seq_len=512,
                    max_batch=1,
                    quantize=scheme,
                    quantize_embeddings=embeddings,
                )
                print(f"compiled {artifact} in {time.perf_counter() - started:.0f}s", file=sys.stderr)
            artifacts.append(artifact)
    runners = [KilnRunner(artifact, args.threads) for artifact in artifacts]
    for precision in [p for p in args.genai.split(",") if p != "none"]:
        genai_dir = build_genai_model(model_dir, Path(f"{args.artifact}-genai-{precision}"), precision)
        runners.append(GenaiRunner(genai_dir, args.threads, precision))
    if args.llamacpp != "none":
        from kiln.frontend.default_model import default_gguf_path

        for quant in args.llamacpp.split(","):
            gguf = quantized_gguf(default_gguf_path(), quant, Path(f"{args.artifact}-llamacpp"))
            runners.append(LlamaCppRunner(gguf, args.threads, quant))
    if not args.skip_hf:
        runners.append(HFRunner(model_dir, compiled=False))
    if not (args.skip_hf or args.skip_hf_compile):
        runners.append(HFRunner(model_dir, compiled=True))
    rows = []
    for test, n in (("pp", args.pp), ("tg", args.tg)):
        rows += measure(runners, test, n, args.reps)
        for row in rows[-len(runners) :]:
            print(f"{row}", file=sys.stderr)
    artifact = artifacts[0]
    weights = kiln.load(artifact).graph.weights
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    params = sum(t.numel() for t in weights.values())
    report = table(rows, weight_bytes, params, args.threads) + "\n\n" + "\n".join(ratios(rows))
    print(report)
    write_result(RESULTS / "latest.md", report)
    (RESULTS / "latest.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
