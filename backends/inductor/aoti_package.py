"""Artifacts as AOTInductor packages: compiled once at save, loaded without tracing or compiling.

What AOTI does for Kiln (torch 2.13, checked by tests/test_inductor_backend.py):
- `torch.export` of the FX module with a `Dim` per graph symbol (bounds from the graph) keeps
  batch and seq dynamic, so one package serves prefill and decode at any batch <= max batch;
- the KV caches stay module buffers that the compiled code writes in place; at load,
  `load_constants(..., user_managed=True)` points them at zero tensors this executable owns, so
  nothing is copied per step and `reset()` is a `zero_()`;
- the package is built without weights (`package_constants_in_so=False`): the artifact already
  has them in safetensors, and at load they are handed over the same zero-copy way.
What it does not do: Inductor's `freezing` (weights folded into the code, oneDNN prepacking)
needs the weights at compile time and bakes them in, so packages are built unfrozen.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.export import Dim

from kiln.backends.executable import BackendOptions, fed_inputs
from kiln.ir import Graph, to_torch
from kiln.ir.errors import ArtifactError, OptionError

from .executable import StatefulRunner, apply_threads, dynamic_dims, without_stack_traces
from .fast_linear import f32_layout_of, lowering_f32_as
from .lower_to_fx import graph_to_fx
from .outline_layers import inline_subgraph_calls, outline_layers
from .quantized_linear import int8_form_of, lowering_int8_as

PACKAGE_FILE = "inductor.pt2"
PACKAGE_INFO_FILE = "inductor.json"
PACKAGE_FORMAT = 1
PACKAGE_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,  # the artifact's safetensors hold the weights
    # Inductor tries to fuse each pair of kernels that share a buffer within this many of each
    # other. Every layer reads the shared rope rows and kv_write index, so the default of 64
    # compares kernels of different layers, which never fuse (SmolLM2: 30k checks, ~5 s of compile).
    "max_fusion_buffer_group_pairwise_attempts": 8,
    # Trust the CPU's flags (/proc/cpuinfo) for the vector ISA instead of proving each one by
    # building and dlopen-ing a probe against ATen's vector headers: with a cold Inductor cache
    # those four g++ builds cost 15-20 s of every compile (the small AVX-512-BF16/VNNI/AMX
    # probes still run). A compiler that lacks a flag the CPU has then fails the kernel build
    # loudly instead of falling back to a narrower ISA.
    "cpp.vec_isa_ok": True,
    # No precompiled headers: torch builds them (~6 s each for the wrapper's and the kernels'
    # headers, 150 MB apiece) into its default cache directory, whatever TORCHINDUCTOR_CACHE_DIR
    # says, to be used once per package; parsing the headers in each build costs ~3 s, and the
    # wrapper's build runs beside the kernels' (_wrapper_built_beside_kernels).
    "aot_inductor.precompile_headers": False,
}


LAYERS_SWITCH = "KILN_INDUCTOR_LAYERS"
PackageError = ArtifactError  # the AOTInductor package is missing, foreign, or does not match the graph


def example_feeds(graph: Graph) -> tuple[torch.Tensor, ...]:
    """Zero tokens/positions (slots, tree) with every dynamic dim at 2 (sizes 0 and 1 would specialize)."""
    inputs = fed_inputs(graph)
    sizes = [[d if isinstance(d, int) else 1 for d in v.type.shape] for v in inputs]  # a block table's width is fixed
    for index, axis, low, high in dynamic_dims(graph):
        sizes[index][axis] = min(max(low, 2), high)
    return tuple(torch.zeros(s, dtype=to_torch(v.type.dtype)) for s, v in zip(sizes, inputs))


def export_module(graph: Graph, module: torch.fx.GraphModule) -> torch.export.ExportedProgram:
    """torch.export of the FX module, batch/seq dynamic within the graph's symbol bounds."""
    dims, shared_dims = {}, {}
    for index, axis, low, high in dynamic_dims(graph):
        name = fed_inputs(graph)[index].type.shape[axis].name
        dims.setdefault(index, {})[axis] = shared_dims.setdefault(name, Dim(name, min=low, max=high))
    dynamic_shapes = tuple(dims.get(i) for i in range(len(fed_inputs(graph))))
    with torch.no_grad():
        return torch.export.export(module, example_feeds(graph), dynamic_shapes=dynamic_shapes, strict=False)


def write_package(graph: Graph, module: torch.fx.GraphModule, options: BackendOptions, directory: Path) -> list[str]:
    """Export and AOT-compile `module` into `directory/inductor.pt2` (weights left out)."""
    directory.mkdir(parents=True, exist_ok=True)
    apply_threads(options)
    with without_stack_traces(), warnings.catch_warnings():
        # torch's own deepcopy of its export specs constructs the deprecated LeafSpec: not ours to fix
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        layer_bodies = _compile_package(graph, module, directory / PACKAGE_FILE)
    info = {
        "format": PACKAGE_FORMAT,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "int8_linear": int8_form_of(module),
        "f32_linear": f32_layout_of(module),
        "layer_bodies": layer_bodies,  # distinct decoder layers compiled once each; 0: the full graph
    }
    (directory / PACKAGE_INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    return [PACKAGE_FILE, PACKAGE_INFO_FILE]


def layers_compiled_once() -> bool:
    """Whether packages compile each distinct decoder layer once (outline_layers.py) rather than
    the full graph: KILN_INDUCTOR_LAYERS=once (the default) or full."""
    choice = os.environ.get(LAYERS_SWITCH, "once")
    if choice not in ("once", "full"):
        raise OptionError(f"{LAYERS_SWITCH}={choice!r} is not a choice. Fix: set it to 'once' or 'full'.")
    return choice == "once"


def _compile_package(graph: Graph, module: torch.fx.GraphModule, path: Path) -> int:
    """AOT-compile the module into the package at `path`; the number of layer bodies it has."""
    with _cpu_flags_trusted(), _wrapper_built_beside_kernels():
        return _compile_program(graph, module, path)


def _compile_program(graph: Graph, module: torch.fx.GraphModule, path: Path) -> int:
    outlined, bodies = outline_layers(module) if layers_compiled_once() else (module, 0)
    if bodies:
        try:
            program = export_module(graph, outlined)
            with inline_subgraph_calls():
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(path), inductor_configs=PACKAGE_CONFIGS
                )
            return bodies
        except Exception as error:  # noqa: BLE001 - torch's subgraph support is young: the full graph still compiles
            warnings.warn(
                f"compiling each layer once failed ({type(error).__name__}: {str(error)[:200]}); "
                "compiling the full graph instead",
                stacklevel=3,
            )
    program = export_module(graph, module)
    torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=PACKAGE_CONFIGS)
    return 0


@contextmanager
def _cpu_flags_trusted():
    """`cpp.vec_isa_ok` for the probes it leaves (AVX-512-BF16, VNNI, AMX, AMX-FP16): each is
    believed when the CPU's flags have it (torch checks them before probing) instead of being
    proven by a g++ build and a dlopen in a child process, ~0.5 s each with a fresh Inductor cache."""
    from torch._inductor.cpu_vec_isa import VecISA

    probe = VecISA.check_build
    VecISA.check_build = lambda self, code: True
    try:
        yield
    finally:
        VecISA.check_build = probe


@contextmanager
def _wrapper_built_beside_kernels():
    """AOTInductor builds the wrapper's object file, then the kernels', one after the other; here
    the wrapper's g++ runs in a thread (the GIL is free while it waits) beside the kernels' build,
    and any later build (the weights, the link) waits for it first."""
    from torch._inductor.cpp_builder import CppBuilder

    build = CppBuilder.build
    pending: list[Future] = []

    def wait_for_wrapper():
        while pending:
            pending.pop().result()  # its CppCompileError, if any, is raised here

    def parallel_build(self):
        target = self.get_target_file_path()
        if target.endswith(".wrapper.o"):
            wait_for_wrapper()
            pending.append(_BUILDS.submit(build, self))
            return
        if not target.endswith(".kernel.o"):
            wait_for_wrapper()
        build(self)

    CppBuilder.build = parallel_build
    try:
        yield
        wait_for_wrapper()
    finally:
        CppBuilder.build = build
        for future in pending:
            future.cancel() or future.exception()  # an abandoned build: wait for it, drop its error


_BUILDS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-wrapper-g++")


class AOTIExecutable(StatefulRunner):
    """A stateful graph run from an AOTInductor package; owns its KV buffers."""

    compile_count = 0  # nothing is compiled at load

    def __init__(self, directory: Path, graph: Graph, weights, options: BackendOptions):
        named_caches = self._init_state(graph, options)
        self.directory = Path(directory)
        info = _read_info(self.directory)
        if info["torch"] != torch.__version__:
            raise PackageError(
                f"{self.directory / PACKAGE_FILE} was built by torch {info['torch']}, this is "
                f"torch {torch.__version__}, and its compiled library runs with its own torch only. "
                "Fix: recompile the artifact with this torch."
            )
        # The FX module is built only to name the constants exactly as at export (no tracing).
        # packages older than linear_q8 say no int8 form ("i8"); older than the panels, no f32 layout
        with lowering_int8_as(info.get("int8_linear", "i8")), lowering_f32_as(info.get("f32_linear", "slabs")):
            module = graph_to_fx(graph, weights, state=named_caches)
        constants = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        self.model = _load_package(self.directory / PACKAGE_FILE)
        # Inductor may fold a small weight into the code (e.g. RoPE's inv_freq): it then needs no feed.
        expected = self.model.get_constant_fqns()
        missing = sorted(set(expected) - set(constants))
        if missing:
            raise PackageError(
                f"{self.directory / PACKAGE_FILE} does not match the graph: it needs "
                f"constants {missing} that the graph does not have; recompile the artifact"
            )
        self.model.load_constants(
            {k: constants[k].detach() for k in expected}, check_full_update=True, user_managed=True
        )
        self._runner = _direct_runner(self.model)

    def _run_front(self, tokens: torch.Tensor, positions: torch.Tensor, *tree_feeds) -> torch.Tensor:
        if self._runner is not None:  # the package's own __call__ re-parses its call spec every call
            return self._runner([tokens, positions, *tree_feeds])[0]
        return self.model(tokens, positions, *tree_feeds)[0]

    def save(self, directory: Path) -> list[str]:
        """Copy the package into `directory` (nothing to recompile)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in (PACKAGE_FILE, PACKAGE_INFO_FILE):
            if (self.directory / name).resolve() != (directory / name).resolve():
                shutil.copyfile(self.directory / name, directory / name)
        return [PACKAGE_FILE, PACKAGE_INFO_FILE]


# What a load leaves on disk (torch 2.13, CPU): AOTIModelPackageLoader unzips the .pt2 into
# $TMPDIR/aotinductor_XXXXXX (its wrapper/kernel .cpp, .json and the .so it dlopens) and its C++
# destructor removes that directory. A normal exit or dropping the model cleans up, but a server
# killed (SIGKILL, the OOM killer, a crash) leaves one directory per load behind in /tmp. Once the
# .so is dlopen-ed nothing in the directory is read again (CPU packages load no kernel files
# lazily; a run after removing it answers the same), so the load is pointed at a private TMPDIR of
# its own, which is removed as soon as the loader is built; the destructor's later removal of the
# gone directory is silent. A kill within the load's own second or so still leaves its directory:
# each is named after its process, and a later load removes those of processes that are gone.
_TMPDIR_LOCK = threading.Lock()  # TMPDIR is process-wide: one load at a time moves it
STAGING_PREFIX = "kiln_aoti_load_"


def _load_package(path: Path):
    """torch._inductor.aoti_load_package(path), leaving nothing unpacked on disk afterwards."""
    _remove_stale_staging()
    staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}_")
    try:
        with _TMPDIR_LOCK:
            previous = os.environ.get("TMPDIR")
            os.environ["TMPDIR"] = staging  # the C++ loader unpacks under std::filesystem::temp_directory_path()
            try:
                return torch._inductor.aoti_load_package(str(path))
            except RuntimeError as error:  # a damaged package, or one whose library this torch cannot run
                first_line = str(error).strip().split("\n", 1)[0][:300]
                raise PackageError(
                    f"{path} cannot be loaded ({first_line}). Fix: recompile the artifact with this Kiln and torch."
                ) from None
            finally:
                if previous is None:
                    del os.environ["TMPDIR"]
                else:
                    os.environ["TMPDIR"] = previous
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging() -> None:
    """Remove the staging directories of loads whose process died during them (a kill, a crash)."""
    for staging in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*_*"):
        pid = staging.name[len(STAGING_PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, as another user's
        return True
    return True


def _direct_runner(model):
    """The loader's flat `boxed_run` when the package takes (tokens, positions) as its two flat
    inputs and returns the logits as its first flat output (what Kiln exports), else None. The
    packaged model's `__call__` parses its pytree specs from JSON on every call (~50 us a step)."""
    from torch.utils import _pytree as pytree

    loader = getattr(model, "loader", None)
    try:
        in_spec, out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        first_output = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)[0]
    except Exception:  # noqa: BLE001 - another loader: keep the public call
        return None
    return loader.boxed_run if in_spec.num_leaves == 2 and first_output == 0 else None


def _read_info(directory: Path) -> dict:
    try:
        info = json.loads((directory / PACKAGE_INFO_FILE).read_text())
    except (OSError, ValueError) as e:
        raise PackageError(
            f"cannot read {directory / PACKAGE_INFO_FILE} ({e}); the artifact has no "
            "valid inductor package: recompile it with backend='inductor'"
        ) from None
    if info.get("format") != PACKAGE_FORMAT or not (directory / PACKAGE_FILE).is_file():
        raise PackageError(f"{directory} holds no inductor package of format {PACKAGE_FORMAT}; recompile the artifact")
    return info


def load(directory: Path, graph: Graph, weights, options: BackendOptions) -> AOTIExecutable:
    """Rebuild the executable from an artifact's graph, weights and AOTInductor package."""
    return AOTIExecutable(Path(directory), graph, weights, options)
