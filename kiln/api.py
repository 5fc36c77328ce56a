"""`kiln.compile` and `kiln.load`: the two calls most users need.

    path = kiln.compile("path/to/hf-model", out="model.kiln", backend="inductor")
    llm = kiln.load(path)

`compile` is a short sequence of named steps (kiln/compile_steps.py) over the stages: frontend
(load, capture) -> passes -> backend -> artifact. Each stage is imported only when used, so
`kiln.load` never pulls in transformers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kiln.backends.executable import BackendOptions
from kiln.backends.registry import get_backend
from kiln.compile_options import CompileOptions
from kiln.compile_steps import CompileSteps, Progress
from kiln.passes.insert_kv_cache import KV_CACHE_KINDS, KV_LAYOUTS
from kiln.runtime.artifact import read_artifact
from kiln.runtime.generate import LLM
from kiln.runtime.tokenizer import Tokenizer


def load(
    path: str | Path, check_hashes: bool = True, device: str | None = None, expected_sha256: str | None = None
) -> LLM:
    """Open the artifact at `path` (checked: versions, sizes, hashes) and ready it to generate,
    on the device it was compiled for, or on `device` ("cpu", "cuda", "cuda:1") if given.

    An artifact is code: loading an inductor artifact runs the shared library in its package.
    Load only artifacts from a source you trust, and pin them: `expected_sha256` is the sha256
    of the artifact's manifest.json (`sha256sum model.kiln/manifest.json`), which lists every
    other file's sha256, so an artifact that is not the one pinned is refused (ArtifactError)
    before any of its code is loaded."""
    contents = _read_rank(Path(path), check_hashes, expected_sha256)
    try:
        backend = get_backend(contents.backend)
        options = backend_options(contents.options, contents.directory / "manifest.json")
        if device is not None:
            options = dataclasses.replace(options, device=device)
        executable = backend.load(contents.directory, contents.graph, contents.graph.weights, options)
    except Exception:
        contents.finish_checks()  # damaged weights explain a failed load better than its own error
        raise
    contents.finish_checks()
    tokenizer = Tokenizer.from_dir(contents.tokenizer_dir) if contents.tokenizer_dir else None
    return LLM(executable, tokenizer, contents.manifest, contents.graph, directory=contents.directory)


def _read_rank(path: Path, check_hashes: bool, expected_sha256: str | None = None):
    """The artifact with this process's weights: under torchrun for a tensor-parallel artifact,
    the process group is joined first (kiln.runtime.distributed) and the rank's shard is read."""
    from kiln.runtime.artifact import read_manifest

    ranks = read_manifest(path, expected_sha256).get("tensor_parallel", 1) if path.is_dir() else 1
    if ranks == 1:  # the weights hashed while the backend loads (only data: code is checked first)
        return read_artifact(path, check_hashes=check_hashes, expected_sha256=expected_sha256, defer_weights_hash=True)
    from kiln.runtime.distributed import join_process_group

    rank = join_process_group(ranks, read_manifest(path)["options"].get("device", "cpu"))
    return read_artifact(path, check_hashes=check_hashes, rank=rank, expected_sha256=expected_sha256)


def backend_options(options: dict, manifest: Path | str = "the artifact's manifest.json") -> BackendOptions:
    """BackendOptions from a manifest's options (which may hold more, e.g. `calibration`); a value
    no backend could run with (a rewritten manifest) raises ArtifactError before any is loaded."""
    from kiln.runtime.errors import ArtifactError

    known = {f.name for f in dataclasses.fields(BackendOptions)}
    chosen = {k: v for k, v in options.items() if k in known}
    for name, value in chosen.items():
        if not OPTION_CHECKS[name](value):
            raise ArtifactError(
                f"{manifest} gives {name}={value!r:.40}, which no backend can run "
                f"with ({OPTION_RULES[name]}). Fix: recompile the artifact."
            )
    return BackendOptions(**chosen)


def _count(value, at_least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= at_least


OPTION_RULES = {
    "max_batch": "an integer >= 1",
    "max_seq_len": "an integer >= 1",
    "threads": "null or an integer >= 1",
    "dtype": "a name",
    "device": "a name",
    "quantize": "null or a scheme name",
    "quantize_embeddings": "true or false",
    "kv_cache": '"f32" or "int8"',
    "kv_layout": '"static" or "paged"',
    "kv_block_size": "an integer >= 1",
    "kv_blocks": "null or an integer >= 2",
}
OPTION_CHECKS = {
    "max_batch": lambda v: _count(v, 1),
    "max_seq_len": lambda v: _count(v, 1),
    "threads": lambda v: v is None or _count(v, 1),
    "dtype": lambda v: isinstance(v, str),
    "device": lambda v: isinstance(v, str),
    "quantize": lambda v: v is None or isinstance(v, str),
    "quantize_embeddings": lambda v: isinstance(v, bool),
    "kv_cache": lambda v: v in KV_CACHE_KINDS,
    "kv_layout": lambda v: v in KV_LAYOUTS,
    "kv_block_size": lambda v: _count(v, 1),
    "kv_blocks": lambda v: v is None or _count(v, 2),
}


def compile(
    model=None,
    out: str | Path = "model.kiln",
    backend: str = "inductor",
    max_seq_len: int = 1024,
    max_batch: int = 1,
    dtype: str = "f32",
    dump_ir: str | Path | None = None,
    progress: Progress | None = None,
    quantize: str | None = None,
    quantize_embeddings: bool = False,
    calibration=None,
    tensor_parallel: int = 1,
    device: str = "cpu",
    cache: bool = True,
    kv_cache: str = "f32",
    kv_layout: str = "static",
    kv_block_size: int = 32,
    kv_blocks: int | None = None,
) -> Path:
    """Compile `model` (a local Hugging Face directory or .gguf file; None = the bundled default,
    SmolLM2-135M-Instruct) into an artifact directory at `out`; returns its path.

    `progress`, if given, is called with a `ProgressEvent` (kiln/compile_progress.py: a str, the
    line, with `kind`, `phase`, `elapsed_s` and `estimate_s`) when each phase (locate, cache
    lookup, load, graph-break check, capture, passes, lower, save, ...) starts and ends;
    `kiln.compile_progress.ProgressBars()` draws them as bars with an ETA on a terminal.

    `cache`: compiling a checkpoint again with the same options copies the artifact compiled
    before from the compile cache (kiln/compile_cache.py; files checked against their hashes
    first). False compiles afresh; `KILN_COMPILE_CACHE=off` turns the cache off everywhere.

    Every compile captures the forward once with Dynamo, writes its graph-break report into the
    artifact (report.md, report.json) and prints the one-line summary ("0 breaks found, 0
    eliminated, 0 left"); a break Kiln cannot remove raises `GraphBreakError` with the report.
    `dump_ir` writes the IR after each pass phase into that directory (never a cache hit).

    `quantize` names a weight scheme ("int8", "int4-g128", "int4-g64-awq", ...; see
    `kiln.passes.quant_schemes.SCHEMES`); `quantize_embeddings` also quantizes the lm_head and the
    token embedding. Data-aware schemes (-awq) run the model on `calibration`: a text file, token
    ids, or None for the bundled Moby-Dick chapters.

    `dtype` is what the weights and activations are computed in: "f32" (every backend; the CPU
    path), or "f16" / "bf16" for GPUs (the model is captured in that dtype as Hugging Face runs
    it: norms in f32; logits come out in f32): backend="inductor" with `device="cuda"` (Triton
    kernels and CUDA graphs, compiled when the artifact is loaded on the GPU; `quantize` too), or
    f16 with backend="onnxruntime". `device` is where the artifact runs; an artifact for CUDA
    compiles on a machine without one.

    `kv_cache` is what the KV buffers hold: "f32", or "int8" (one byte per number with an f32
    scale per token and head: 3.8x fewer bytes per token at head_dim 64; Inductor and the
    reference backend, see docs/kv-cache.md). `kv_layout="paged"` lays it out as a pool of
    `kv_blocks` blocks of `kv_block_size` tokens per layer (None: as many tokens as max_batch full
    rows) addressed through a block table, which the engine fills as requests grow and shares
    between requests with a common prefix (Inductor, ONNX Runtime and the reference backend).

    `tensor_parallel` N > 1 shards the graph over N ranks (the pipeline's last phase) and
    writes one artifact with every rank's weights; run it with `torchrun --nproc-per-node N`.
    """
    options = CompileOptions.checked(  # every option, before any slow step
        model=model,
        out=out,
        backend=backend,
        max_seq_len=max_seq_len,
        max_batch=max_batch,
        dtype=dtype,
        device=device,
        quantize=quantize,
        quantize_embeddings=quantize_embeddings,
        calibration=calibration,
        tensor_parallel=tensor_parallel,
        dump_ir=dump_ir,
        kv_cache=kv_cache,
        kv_layout=kv_layout,
        kv_block_size=kv_block_size,
        kv_blocks=kv_blocks,
    )
    steps = CompileSteps(options, progress, cache=cache)
    steps.locate()
    cached = steps.reuse_cached()
    if cached is not None:
        return cached
    steps.load_model()  # and check that its KV cache fits this machine
    calibration_tokens, calibration_source = steps.calibration_tokens()
    breaks, built = steps.check_breaks_and_build(calibration_tokens)  # capture -> passes -> lower
    path = steps.save(breaks, built, calibration_source)
    steps.remember(path)
    return path
