"""The steps of `kiln.compile`, in the order `kiln/api.py` runs them:

    locate the model -> the compile cache (a hit copies the artifact compiled before and ends
    here) -> load -> calibration tokens (-awq schemes) -> graph-break check, beside or before
    capture -> pass pipeline (tensor-parallel sharding its last phase) -> lower -> save -> store
    in the compile cache

Each phase reports its start (with the seconds it took the last compile of a similar size, the
estimate a progress bar counts down) and its end through `progress` (kiln/compile_progress.py).
The graph-break check (Dynamo, tens of seconds for a large model) runs in a child process beside
the capture when a spare core makes that pay (frontend/breaks/background_check.py); its verdict
decides whether the graph built meanwhile stands. Stages are imported when a step runs, so
`import kiln` stays light.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kiln.backends.registry import backend_version, get_backend
from kiln.compile_cache import CompileCache, cache_dir, compile_key, max_bytes
from kiln.compile_options import CompileOptions, check_memory
from kiln.compile_progress import ProgressEvent
from kiln.phase_times import PhaseTimes

Progress = Callable[[str], None]  # called with ProgressEvents (str subclasses)


@dataclass
class Built:
    """What capture, the passes and the backend made: the stateful graph (rank 0's when sharded),
    its executable, and the weights of ranks 1..N-1 (None unless sharded)."""

    graph: object
    executable: object
    rank_weights: list | None


class CompileSteps:
    """One compile's steps; `kiln.api.compile` calls them in order."""

    def __init__(self, options: CompileOptions, progress: Progress | None, cache: bool = True):
        self.options = options
        self.progress = progress
        self.backend = get_backend(options.backend)
        self.started = time.perf_counter()
        self.model = options.model  # the default model's directory once located
        self.checkpoint_dir: Path | None = None
        self.weight_bytes: int | None = None  # the checkpoint's size, which phase estimates scale with
        self.loaded = None
        self.early_check = None  # the graph-break check's child, when started before the load
        directory = cache_dir()
        # IR dumps are written while compiling, so a compile asked for them is never a cache hit
        self.cache = CompileCache(directory) if cache and directory is not None and options.dump_ir is None else None
        if self.cache is not None:
            max_bytes()  # a malformed bound fails now, not after the compile
        self.cache_key = None
        self.times = PhaseTimes(directory, group=f"{options.backend}/{options.quantize or 'none'}")

    def locate(self) -> Path:
        """The checkpoint's directory: the bundled default when none is named, a GGUF file
        converted on first use."""
        from kiln.frontend.checkpoint import resolve_checkpoint_dir

        with self.step("locate", "locate the default model" if self.model is None else f"locate {self.model}"):
            if self.model is None:
                from kiln.frontend.default_model import default_model_dir

                self.model = default_model_dir()
            self.checkpoint_dir = resolve_checkpoint_dir(self.model)
        self.weight_bytes = sum(p.stat().st_size for p in self.checkpoint_dir.glob("*.safetensors"))
        return self.checkpoint_dir

    def reuse_cached(self) -> Path | None:
        """The artifact at options.out copied from the compile cache, or None (compile it)."""
        if self.cache is None:
            return None
        with self.step("cache", "look up the compile cache"):
            self.cache_key = compile_key(
                self.checkpoint_dir, self.options, backend_version(self.backend), self.cache.root
            )
            cached, dropped = self.cache.lookup(self.cache_key) if self.cache_key else (None, None)
        if dropped:
            self.summary(f"compile cache: a damaged entry was deleted ({dropped}); compiling again")
        if cached is None:
            return None
        with self.step("reuse", f"copy the cached artifact to {self.options.out}"):
            path = self.cache.copy_out(cached, Path(self.options.out), str(self.checkpoint_dir))
        self.times.save()
        self.summary(
            "compile cache hit: the artifact compiled before from this checkpoint with these options "
            "(to compile afresh: --no-cache, or cache=False)"
        )
        return path

    def load_model(self):
        """The checkpoint, loaded; the KV cache its shape and the options ask for is checked
        against this machine's memory before anything else."""
        from kiln.frontend.checkpoint import load_model

        if self.checkpoint_dir is None:
            self.locate()
        self.early_check = self.start_break_check_early()
        try:
            with self.step("load", f"load {self.model}"), _quiet_loading():
                self.loaded = load_model(self.checkpoint_dir)
            check_memory(self.loaded.model.config, self.options)
            check_reward_options(self.loaded.model, self.options)
        except BaseException:
            if self.early_check is not None:
                self.early_check.cancel()
            raise
        return self.loaded

    def start_break_check_early(self):
        """The graph-break check's child started before the load (sized by the checkpoint's
        safetensors files), so its own start and load overlap the parent's; None where the child
        starts later or not at all (a calibrated compile runs steps between load and build)."""
        from kiln.frontend.breaks.background_check import start_if_worthwhile

        if self.options.needs_calibration or not self.weight_bytes:
            return None
        return start_if_worthwhile(self.checkpoint_dir, self.weight_bytes, str(self.model))

    def calibration_tokens(self):
        """(token rows, where they came from) for a data-aware scheme; (None, None) otherwise."""
        if not self.options.needs_calibration:
            return None, None
        from kiln.calibration import calibration_tokens

        return calibration_tokens(self.options.calibration, self.loaded.tokenizer_path, self.options.max_seq_len)

    def check_breaks_and_build(self, calibration) -> tuple[object, Built]:
        """(the graph-break report, what `build` made). The check runs first, or in a child
        process beside the build; breaks Kiln removes by rewriting the model's branches (only
        the check here can) mean a second build."""
        from kiln.frontend.breaks.background_check import start_if_worthwhile

        model = self.loaded.model
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        background = self.early_check or start_if_worthwhile(self.loaded.checkpoint_dir, param_bytes, str(self.model))
        if background is None:
            breaks = self.check_breaks()
            self.summary(f"graph breaks: {breaks.summary_line()}")
            return breaks, self.build(calibration)
        self.report(ProgressEvent.note("check graph breaks (Dynamo) in a child process, beside the capture"))
        try:
            built = self.build(calibration)
        except Exception:
            background.cancel()
            self.check_breaks()  # a graph break explains a failed capture best (GraphBreakError)
            raise
        with self.step("wait-breaks", "wait for the graph-break check"):
            breaks = background.clean_result()
        if breaks is None:  # breaks found: the check here raises, or rewrites the model's branches
            breaks = self.check_breaks()
            built = self.build(calibration)
        self.summary(f"graph breaks: {breaks.summary_line()}")
        return breaks, built

    def check_breaks(self):
        """The graph-break report of the stateless forward; GraphBreakError if a break is left."""
        from kiln.frontend.breaks.compile_check import check_graph_breaks

        with self.step("breaks", "check graph breaks (Dynamo)"):
            return check_graph_breaks(self.loaded.model, str(self.model))

    def build(self, calibration) -> Built:
        """Capture -> the pass pipeline (passes/pipeline.py, sharding included) -> the backend."""
        from kiln.frontend.capture import capture_causal_lm
        from kiln.passes.pipeline import run_pipeline

        options, notes = self.options, []
        with self.step("capture", "capture the forward into IR"):
            graph = capture_causal_lm(
                self.loaded.model,
                max_batch=options.max_batch,
                max_seq_len=options.max_seq_len,
                dtype=options.torch_dtype,
                note=notes.append,
            )
        for line in notes:  # how the decoder layers were traced (each kind once, or why not)
            self.summary(line)
        rank_weights = [] if options.tensor_parallel > 1 else None
        with self.step("passes", "run the pass pipeline"):
            graph = run_pipeline(
                graph, options, dump_dir=options.dump_ir, calibration=calibration, rank_weights=rank_weights
            )
        if rank_weights is not None:
            return Built(graph, CompiledPerRank(), rank_weights)
        with self.step("lower", f"lower with the {options.backend} backend"):
            return Built(graph, self.backend.lower(graph, options.backend_options()), None)

    def save(self, breaks, built: Built, calibration_source: str | None) -> Path:
        """The artifact at options.out, with the graph-break report and the manifest."""
        from kiln.frontend.breaks.background_check import CleanBreaks
        from kiln.frontend.breaks.compile_check import report_files
        from kiln.runtime.artifact import save_artifact

        options, loaded = self.options, self.loaded
        with self.step("save", f"save the artifact to {options.out}"):
            return save_artifact(
                options.out,
                built.graph,
                built.executable,
                tokenizer_dir=loaded.tokenizer_path.parent,
                extra_files=breaks.files if isinstance(breaks, CleanBreaks) else report_files(breaks),
                rank_weights=built.rank_weights,
                manifest_fields={
                    "backend": options.backend,
                    "backend_version": backend_version(self.backend),
                    "source": str(loaded.checkpoint_dir),
                    "source_hash": loaded.source_hash,
                    "options": options.manifest_options(calibration_source),
                    "graph_stats": {
                        **graph_stats(built.graph),
                        "compile_s": round(time.perf_counter() - self.started, 3),
                    },
                    "graph_breaks": breaks.counts,
                    **task_field(built.graph),
                },
            )

    def remember(self, path: Path) -> None:
        """Store the artifact just saved in the compile cache, and this compile's phase times."""
        if self.cache is not None and self.cache_key is not None:
            with self.step("store", "store the artifact in the compile cache"):
                self.cache.store(self.cache_key, Path(path))
        self.times.save()

    # -- reporting ----------------------------------------------------------------------------
    def report(self, event: ProgressEvent) -> None:
        if self.progress is not None:
            self.progress(event)

    def summary(self, line: str) -> None:
        """A line every compile prints: through `progress` when given, else on stderr."""
        if self.progress is not None:
            self.progress(ProgressEvent.note(line))
        else:
            print(line, file=sys.stderr, flush=True)

    @contextmanager
    def step(self, phase: str, title: str):
        """Report the phase's start (with its estimate) and end, and record how long it took."""
        self.report(ProgressEvent.start(phase, title, self.times.estimate(phase, self.weight_bytes)))
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.report(ProgressEvent.failed(phase, title, time.perf_counter() - start))
            raise
        elapsed = time.perf_counter() - start
        self.times.add(phase, self.weight_bytes, elapsed)
        self.report(ProgressEvent.done(phase, title, elapsed))


@contextmanager
def _quiet_loading():
    """Without transformers' "Loading weights" bar: the compile's own progress covers the phase."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


class CompiledPerRank:
    """The executable of a tensor-parallel artifact is built in each rank when it is loaded (a
    compile needs the ranks' process group), so there are no backend files to save."""

    def save(self, directory) -> list[str]:
        return []


def check_reward_options(model, options: CompileOptions) -> None:
    """OptionError for what a reward model cannot be compiled with: tensor parallelism shards the
    lm_head by vocabulary rows, and a score head has one."""
    from kiln.frontend.capture import is_reward_model
    from kiln.ir.errors import OptionError

    if options.tensor_parallel > 1 and is_reward_model(model):
        raise OptionError(
            f"{type(model).__name__} is a reward model, whose one-column score head cannot be "
            "sharded by vocabulary. Fix: compile it with tensor_parallel=1."
        )


def task_field(graph) -> dict:
    """{"task": "reward"} for a reward model (the runtime refuses to generate with it); nothing
    for a causal LM, whose manifests stay as they were."""
    return {"task": "reward"} if graph.meta.get("model", {}).get("task") == "reward" else {}


def graph_stats(graph) -> dict:
    """Counts for the compile summary: nodes, nodes per op, parameters and their bytes."""
    return {
        "nodes": len(graph.nodes),
        "ops": dict(Counter(n.op for n in graph.nodes).most_common()),
        "params": len(graph.params),
        "param_bytes": sum(t.numel() * t.element_size() for t in graph.weights.values()),
    }
