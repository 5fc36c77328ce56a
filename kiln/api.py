"""`kiln.compile` and `kiln.load`: the two calls most users need.

    path = kiln.compile("path/to/hf-model", out="model.kiln", backend="inductor")
    llm = kiln.load(path)

`compile` is glue over the stages: frontend (load, capture) -> passes -> backend -> artifact.
Each stage is imported only when used, so `kiln.load` never pulls in transformers.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from kiln.backends.executable import BackendOptions
from kiln.backends.registry import backend_version, get_backend
from kiln.compile_options import CompileOptions, check_memory
from kiln.runtime.artifact import read_artifact, save_artifact
from kiln.runtime.generate import LLM
from kiln.runtime.tokenizer import Tokenizer

Progress = Callable[[str], None]


def load(path: str | Path, check_hashes: bool = True, device: str | None = None) -> LLM:
    """Open the artifact at `path` (checked: versions, sizes, hashes) and ready it to generate,
    on the device it was compiled for, or on `device` ("cpu", "cuda", "cuda:1") if given."""
    contents = _read_rank(Path(path), check_hashes)
    backend = get_backend(contents.backend)
    options = backend_options(contents.options)
    if device is not None:
        options = dataclasses.replace(options, device=device)
    executable = backend.load(contents.directory, contents.graph, contents.graph.weights, options)
    tokenizer = Tokenizer.from_dir(contents.tokenizer_dir) if contents.tokenizer_dir else None
    return LLM(executable, tokenizer, contents.manifest, contents.graph)


def _read_rank(path: Path, check_hashes: bool):
    """The artifact with this process's weights: under torchrun for a tensor-parallel artifact,
    the process group is joined first (kiln.runtime.distributed) and the rank's shard is read."""
    from kiln.runtime.artifact import read_manifest

    ranks = read_manifest(path).get("tensor_parallel", 1) if path.is_dir() else 1
    if ranks == 1:
        return read_artifact(path, check_hashes=check_hashes)
    from kiln.runtime.distributed import join_process_group

    rank = join_process_group(ranks, read_manifest(path)["options"].get("device", "cpu"))
    return read_artifact(path, check_hashes=check_hashes, rank=rank)


def backend_options(options: dict) -> BackendOptions:
    """BackendOptions from a manifest's options (which may hold more, e.g. `quantize`)."""
    known = {f.name for f in dataclasses.fields(BackendOptions)}
    return BackendOptions(**{k: v for k, v in options.items() if k in known})


def compile(model=None, out: str | Path = "model.kiln", backend: str = "inductor", max_seq_len: int = 1024,
            max_batch: int = 1, dtype: str = "f32", dump_ir: str | Path | None = None,
            progress: Progress | None = None, quantize: str | None = None, quantize_embeddings: bool = False,
            calibration=None, tensor_parallel: int = 1, device: str = "cpu") -> Path:
    """Compile `model` (a local Hugging Face directory or .gguf file; None = the bundled default,
    SmolLM2-135M-Instruct) into an artifact directory at `out`; returns its path.

    `progress`, if given, is called with one line per step (load, graph-break check, capture,
    passes, lower, save) and the seconds each took. Every compile captures the forward once with
    Dynamo, writes its graph-break report into the artifact (report.md, report.json) and prints
    the one-line summary ("0 breaks found, 0 eliminated, 0 left"); a break Kiln cannot remove
    raises `GraphBreakError` with the report. `dump_ir` writes the IR after each pass phase into
    that directory.

    `quantize` names a weight scheme ("int8", "int4-g128", "int4-g64-awq", ...; see
    `kiln.passes.quant_schemes.SCHEMES`); `quantize_embeddings` also quantizes the lm_head and the
    token embedding. Data-aware schemes (-awq) run the model on `calibration`: a text file, token
    ids, or None for the bundled Moby-Dick chapters.

    `dtype` is what the weights and activations are computed in: "f32" (every backend; the CPU
    path), or "f16" for GPUs, lowered by the onnxruntime backend for `device="cuda"` (the model
    is captured in f16 as Hugging Face runs it: norms in f32; logits come out in f32). `device`
    is where the artifact runs; an artifact for CUDA compiles on a machine without one.

    `tensor_parallel` N > 1 shards the graph over N ranks (kiln.passes.shard_tensor_parallel) and
    writes one artifact with every rank's weights; run it with `torchrun --nproc-per-node N`.
    """
    from kiln.frontend.breaks.background_check import CleanBreaks, start_if_worthwhile
    from kiln.frontend.breaks.compile_check import check_graph_breaks, report_files
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.passes.pipeline import run_pipeline

    report = progress or (lambda message: None)
    started = time.perf_counter()
    checked = CompileOptions.checked(  # every option, before the slow steps
        model=model, out=out, backend=backend, max_seq_len=max_seq_len, max_batch=max_batch, dtype=dtype,
        device=device, quantize=quantize, quantize_embeddings=quantize_embeddings, calibration=calibration,
        tensor_parallel=tensor_parallel, dump_ir=dump_ir)
    quantize, scheme, options = checked.quantize, checked.scheme, checked.backend_options()
    backend_module = get_backend(backend)
    if model is None:
        from kiln.frontend.default_model import default_model_dir

        with _step(report, "locate the default model"):
            model = default_model_dir()
    with _step(report, f"load {model}"):
        loaded = load_model(model)
    check_memory(loaded.model.config, checked)
    tokens, calibration_source = None, None
    if scheme is not None and scheme.needs_calibration:
        from kiln.calibration import calibration_tokens

        tokens, calibration_source = calibration_tokens(calibration, loaded.tokenizer_path, max_seq_len)

    def check_here():
        with _step(report, "check graph breaks (Dynamo)"):
            return check_graph_breaks(loaded.model, str(model))  # raises GraphBreakError if any is left

    def capture_and_lower():
        with _step(report, "capture the forward into IR"):
            graph = capture_causal_lm(loaded.model, max_batch=max_batch, max_seq_len=max_seq_len,
                                      dtype=checked.torch_dtype)
        with _step(report, "run the pass pipeline"):
            graph = run_pipeline(graph, options, dump_dir=dump_ir, calibration=tokens)
        if tensor_parallel > 1:
            with _step(report, f"shard over {tensor_parallel} ranks"):
                graph, rank_weights = _shard(graph, tensor_parallel)
            return graph, _CompiledPerRank(), rank_weights
        with _step(report, f"lower with the {backend} backend"):
            return graph, backend_module.lower(graph, options), None

    param_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    background = start_if_worthwhile(loaded.checkpoint_dir, param_bytes, str(model))
    if background is None:
        breaks = check_here()
        _summary(progress, f"graph breaks: {breaks.summary_line()}")
        graph, executable, rank_weights = capture_and_lower()
    else:
        report("check graph breaks (Dynamo) in a child process, beside the capture ...")
        try:
            graph, executable, rank_weights = capture_and_lower()
        except Exception:
            background.cancel()
            check_here()  # a graph break explains a failed capture best (GraphBreakError)
            raise
        with _step(report, "wait for the graph-break check"):
            breaks = background.clean_result()
        if breaks is None:  # breaks found: the check here raises, or rewrites the model's branches
            breaks = check_here()
            graph, executable, rank_weights = capture_and_lower()
        _summary(progress, f"graph breaks: {breaks.summary_line()}")
    with _step(report, f"save the artifact to {out}"):
        path = save_artifact(out, graph, executable, tokenizer_dir=loaded.tokenizer_path.parent,
                             extra_files=breaks.files if isinstance(breaks, CleanBreaks) else report_files(breaks),
                             rank_weights=rank_weights, manifest_fields={
            "backend": backend,
            "backend_version": backend_version(backend_module),
            "source": str(loaded.checkpoint_dir),
            "source_hash": loaded.source_hash,
            "options": checked.manifest_options(calibration_source),
            "graph_stats": {**graph_stats(graph), "compile_s": round(time.perf_counter() - started, 3)},
            "graph_breaks": breaks.counts,
        })
    return path


def _shard(graph, ranks: int):
    """Rank 0's graph (the same for every rank) and the weights of ranks 1..N-1."""
    from kiln.passes.shard_tensor_parallel import shard_tensor_parallel

    shards = [shard_tensor_parallel(graph, rank, ranks) for rank in range(ranks)]
    return shards[0], [shard.weights for shard in shards[1:]]


class _CompiledPerRank:
    """The executable of a tensor-parallel artifact is built in each rank when it is loaded (a
    compile needs the ranks' process group), so there are no backend files to save."""

    def save(self, directory) -> list[str]:
        return []


def graph_stats(graph) -> dict:
    """Counts for the compile summary: nodes, nodes per op, parameters and their bytes."""
    return {
        "nodes": len(graph.nodes),
        "ops": dict(Counter(n.op for n in graph.nodes).most_common()),
        "params": len(graph.params),
        "param_bytes": sum(t.numel() * t.element_size() for t in graph.weights.values()),
    }


def _summary(progress: Progress | None, line: str) -> None:
    """A line every compile prints: through `progress` when given, else on stderr."""
    if progress is not None:
        progress(line)
    else:
        print(line, file=sys.stderr, flush=True)


@contextmanager
def _step(report: Progress, what: str):
    report(f"{what} ...")
    start = time.perf_counter()
    yield
    report(f"{what}: done in {time.perf_counter() - start:.1f}s")
