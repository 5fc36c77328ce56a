"""Kiln's CPU linear kernels for decode: fp32 and int8 weight-only GEMV as torch custom ops.

Usage::

    from kiln.backends.inductor import gemv_kernel as gk
    gk.ensure_loaded()                      # builds once (cached), registers the ops
    wt = gk.pack_linear_weight(linear.weight)          # [N, K] -> packed, logical [K, N] (= W.t())
    y = torch.ops.kiln.linear_f32(x, wt, linear.bias)  # == F.linear(x, W, b); x: [..., K]

    wq, scales = gk.pack_linear_weight_int8(linear.weight)   # int8 [K, N], fp32 [N]
    y = torch.ops.kiln.linear_i8(x, wq, scales, bias)        # == F.linear(x, W_dequant, b)

The Inductor lowering uses a third fp32 layout, ``pack_linear_weight(w, "panels")`` with
``torch.ops.kiln.linear_f32_panels(x, panels, panel_width(N), bias)`` (``gemv_panels.h``): panels of
32 or 64 columns, each one sequential stream, for every M, one FMA chain per output in K order
(the same bits at any row count, thread count or instruction set).

Layout for ``linear_f32``: the packed fp32 weight has logical shape ``[K, N]`` (= ``W.t()``) in one of two memory
layouts: "kn" (contiguous ``[K, N]``, what ``pack_linear_weight`` makes by default) and "nk" (the
``[N, K]`` weight seen through ``.t()``, no copy). For "kn" and M = 1..128 rows (M =
prod(x.shape[:-1])) the op streams the weight from memory once per call over torch's intra-op
threads (split over K, or over N for very wide outputs), in slabs read side by side with software
prefetch: up to 8 rows of x take AVX2 GEMV steps; 9..128 rows (speculative verification, batched
decode, prefill chunks) take blocks of up to 12 rows of x per weight tile held in L1 (AVX-512 where the CPU has
it, else AVX2); up to 128 rows (the engine's prefill chunk) this beats MKL's GEMM (1.2-1.6x on
SmolLM2's linears). Above 128 rows (long prefill), and always for "nk", it is one MKL GEMM ``x @ packed``
-- no second copy of any weight. Fused projections are packed from ``torch.cat([Wq, Wk, Wv])``.
Any K and N work; float32 activations only; CPU only; the CPU must have AVX2 and FMA. The int8
weight is always contiguous ``[K, N]`` (kernel for M <= 128, each int8 tile widened to f32 once
for all rows of x from 4 rows up; for larger M it is dequantized per call and run by MKL).
Inference only (no autograd). ``torch.ops.kiln.gemv_use_avx512(False)`` forces the AVX2 kernel
(tests run both).

Both ops have fake (meta) implementations, so a ``torch.compile(fullgraph=True)`` graph calls them
without a graph break (Inductor keeps them as extern calls).

The shared library is compiled with the system C++ compiler (``$CXX`` or ``g++``; no ninja, no
pybind) into ``$KILN_CACHE/ext`` (default ``~/.cache/kiln/ext``), keyed by the source, flags, torch
version and compiler, and loaded with ``torch.ops.load_library``. A first build (two translation
units compiled in parallel) takes ~20 s on 2 idle cores, ~40 s on a loaded machine.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from kiln.backends.errors import LoweringError
from kiln.ir.errors import KilnError, OptionError

__all__ = [
    "SMALL_M",
    "KernelBuildError",
    "ensure_loaded",
    "library_path",
    "linear_f32",
    "linear_f32_panels",
    "linear_i8",
    "pack_linear_weight",
    "pack_linear_weight_int8",
    "packed_layout",
    "panel_width",
]

_SRC = Path(__file__).with_name("gemv_kernel.cpp")
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c++20", "-w"]
_KERNEL_FLAGS = ["-mavx2", "-mfma", "-mf16c"]  # only the SIMD translation unit; no -march=native (CI/other CPUs)
SMALL_M = 128  # rows handled by Kiln's kernels; above this the op runs MKL (kSmallM in the .cpp)

_lock = threading.Lock()
_loaded_path: str | None = None


class KernelBuildError(KilnError, RuntimeError):
    """The C++ kernel could not be built or loaded (no compiler, unsupported CPU, ...)."""


def _cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
    return Path(root) / "ext"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise KernelBuildError(
            f"kiln GEMV kernel: C++ compiler {cxx!r} not found on PATH. Install g++ "
            "(e.g. `apt-get install g++`) or point $CXX at a C++20 compiler."
        )
    return path


def _check_cpu() -> None:
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        raise KernelBuildError(f"kiln GEMV kernel needs a CPU with AVX2 and FMA (torch reports capability {cap!r})")


def _build_cmds(cxx: str, src: Path, out: Path) -> list[list[str]]:
    """Two compile commands (run in parallel) and one link command."""
    from torch.utils import cpp_extension

    lib = str(Path(torch.__file__).parent / "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    incs = [a for inc in cpp_extension.include_paths() for a in ("-isystem", inc)]
    kern_o, ops_o = str(out) + ".kern.o", str(out) + ".ops.o"
    return [
        [cxx, *_FLAGS, *_KERNEL_FLAGS, "-c", "-DKILN_GEMV_KERNELS", str(src), "-o", kern_o],
        [cxx, *_FLAGS, "-c", abi, *incs, str(src), "-o", ops_o],
        [
            cxx,
            *_FLAGS,
            "-shared",
            kern_o,
            ops_o,
            "-o",
            str(out),
            f"-L{lib}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{lib}",
        ],
    ]


def _run_build(cmds: list[list[str]]) -> None:
    def fail(cmd, r_out):
        raise KernelBuildError("kiln GEMV kernel: compilation failed:\n  " + " ".join(cmd) + "\n" + r_out[-4000:])

    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds[:2]]
    for cmd, p in zip(cmds[:2], procs):
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            for q in procs:
                q.kill()
            fail(cmd, out)
    r = subprocess.run(cmds[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    if r.returncode != 0:
        fail(cmds[2], r.stdout)


def library_path() -> Path:
    """Path of the cached shared library for this source/torch/compiler (may not exist yet)."""
    return _cache_dir() / f"kiln_gemv_{_build_key(_SRC)}.so"


def _build_key(src: Path) -> str:
    """What a built library depends on: the source and the headers beside it, flags, torch, compiler."""
    cxx = _compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError as e:  # pragma: no cover - broken compiler install
        raise KernelBuildError(f"kiln kernels: cannot run {cxx}: {e}") from e
    digest = hashlib.sha256()
    sources = [src.read_bytes()] + [h.read_bytes() for h in sorted(src.parent.glob("*.h"))]
    for part in (
        *sources,
        " ".join(_FLAGS + _KERNEL_FLAGS).encode(),
        torch.__version__.encode(),
        cxx.encode(),
        version.encode(),
        sys.platform.encode(),
    ):
        digest.update(part + b"\0")
    return digest.hexdigest()[:16]


def _build(out: Path, src: Path = _SRC, kernel_define: str = "KILN_GEMV_KERNELS") -> None:
    """Compile `src` into `out` (its SIMD unit with -D<kernel_define>), once across processes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / (out.name + ".lock"), "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # concurrent processes (pytest -n, CI) build once
        try:
            if out.exists():
                return
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
            os.close(fd)
            cmds = _build_cmds(_compiler(), src, Path(tmp))
            cmds[0] = [a.replace("-DKILN_GEMV_KERNELS", f"-D{kernel_define}") for a in cmds[0]]
            try:
                _run_build(cmds)
                os.replace(tmp, out)
            finally:
                for f in (tmp, tmp + ".kern.o", tmp + ".ops.o"):
                    if os.path.exists(f):
                        os.unlink(f)
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)


_extensions_loaded: set[str] = set()


def load_extension(src: Path, kernel_define: str, name: str, register_fake) -> None:
    """Build (once, cached under $KILN_CACHE/ext) and load another Kiln kernel file laid out like
    this one (its SIMD translation unit compiled with `-D<kernel_define>`, its torch binding
    without), then `register_fake()` its ops' fake implementations. The library is keyed by
    source, flags, torch and compiler. Idempotent per `name`."""
    with _lock:
        if name not in _extensions_loaded:
            _load_extension(src, kernel_define, name, register_fake)
            _extensions_loaded.add(name)


def _load_extension(src: Path, kernel_define: str, name: str, register_fake) -> None:
    _check_cpu()
    out = _cache_dir() / f"{name}_{_build_key(src)}.so"
    if not out.exists():
        _build(out, src, kernel_define)
    try:
        torch.ops.load_library(str(out))
    except OSError as error:
        raise KernelBuildError(f"{name}: cannot load {out}: {error}") from error
    register_fake()


def kernel_loads(ensure_loaded, consequence: str) -> bool:
    """Whether `ensure_loaded()` builds and loads a kernel here; if not, warn with `consequence`
    (what runs instead) and the reason."""
    try:
        ensure_loaded()
        return True
    except KernelBuildError as error:
        warnings.warn(f"{consequence}: {error}", stacklevel=3)
        return False


def kernel_chosen(env_switch: str, kernel: str, alternative: str) -> bool:
    """`env_switch` ("kiln", the default, or "torch") asks for Kiln's kernel or torch's ops."""
    choice = os.environ.get(env_switch, "kiln").lower()
    if choice not in ("kiln", "torch"):
        raise OptionError(
            f"{env_switch}={choice!r} is not a choice. Fix: set it to 'kiln' ({kernel}) or 'torch' "
            f"({alternative}), or unset it."
        )
    return choice == "kiln"


def _ops_registered() -> bool:
    try:
        return all(
            torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CPU")
            for op in ("linear_f32", "linear_i8", "linear_f32_panels")
        )
    except RuntimeError:  # "operator ... does not exist"
        return False


def _has_fake(op: str) -> bool:
    try:
        from torch._library.simple_registry import singleton

        return singleton.find(op).fake_impl.kernel is not None
    except Exception:  # noqa: BLE001 - private API moved: assume not registered
        return False


def _register_fakes() -> None:
    if _has_fake("kiln::linear_f32") and _has_fake("kiln::linear_i8") and _has_fake("kiln::linear_f32_panels"):
        return

    @torch.library.register_fake("kiln::linear_f32")
    def _linear_f32_fake(x, packed_weight, bias=None):
        torch._check(x.shape[-1] == packed_weight.shape[0])
        return x.new_empty((*x.shape[:-1], packed_weight.shape[1]))

    @torch.library.register_fake("kiln::linear_f32_panels")
    def _linear_f32_panels_fake(x, panels, width, bias=None):
        torch._check(x.shape[-1] == panels.shape[0])
        return x.new_empty((*x.shape[:-1], panels.shape[1]))

    @torch.library.register_fake("kiln::linear_i8")
    def _linear_i8_fake(x, packed_weight, scales, bias=None):
        torch._check(x.shape[-1] == packed_weight.shape[0])
        return x.new_empty((*x.shape[:-1], packed_weight.shape[1]))


def ensure_loaded() -> str:
    """Build (once, cached) and load the kernels; registers ``torch.ops.kiln.linear_f32`` and
    ``torch.ops.kiln.linear_i8`` with fake impls. Returns the library path. Idempotent."""
    global _loaded_path
    with _lock:
        if _loaded_path is not None:
            return _loaded_path
        _check_cpu()
        if _ops_registered():  # loaded by someone else in this process (e.g. an older cache path)
            _register_fakes()
            _loaded_path = "<already registered>"
            return _loaded_path
        path = library_path()
        if not path.exists():
            _build(path)
        try:
            torch.ops.load_library(str(path))
        except OSError as e:
            raise KernelBuildError(f"kiln GEMV kernel: cannot load {path}: {e}") from e
        _register_fakes()
        _loaded_path = str(path)
        return _loaded_path


@torch.no_grad()
def pack_linear_weight(w: torch.Tensor, layout: str = "auto") -> torch.Tensor:
    """nn.Linear weight ``[N, K]`` -> packed fp32 weight of logical shape ``[K, N]``, done once at
    load time. For fused projections pass ``torch.cat([W1, W2, ...], dim=0)``.

    layout: ``"kn"`` = ``W.t().contiguous()`` (Kiln's slab kernels for M <= 128, MKL above);
    ``"nk"`` = ``W.contiguous().t()``, a transposed view of the [N, K] weight (MKL for every M;
    shares storage with ``w`` when ``w`` is already contiguous fp32); ``"panels"`` = ``W.t()`` cut
    into panels of ``panel_width(N)`` columns, each stored ``[K, width]`` (for
    ``linear_f32_panels``); ``"auto"`` = ``"kn"``. To serialize, save the original weight and
    re-pack at load."""
    if w.dim() != 2:
        raise LoweringError(f"pack_linear_weight: expected a 2-D [N, K] weight, got {tuple(w.shape)}")
    if layout == "auto":
        layout = "kn"
    w = w.detach().to(torch.float32)
    if layout == "kn":
        return w.t().contiguous()
    if layout == "nk":
        return w.contiguous().t()  # shares storage with a contiguous fp32 w (no copy)
    if layout == "panels":
        n, k = w.shape
        width = panel_width(n)
        pieces = [w[c : c + width].t().contiguous().view(-1) for c in range(0, n, width)]
        return (torch.cat(pieces) if pieces else w.new_empty(0)).view(k, n)
    raise LoweringError(f"pack_linear_weight: layout must be 'auto', 'kn', 'nk' or 'panels', got {layout!r}")


def panel_width(n: int) -> int:
    """Columns per panel of a ``"panels"`` weight with N outputs: 64 (a 6-row x 64-column register
    tile) where two threads get equal shares of the panels or there are many, else 32."""
    return 64 if n % 128 == 0 or n >= 2048 else 32


def packed_layout(packed: torch.Tensor) -> str:
    """ "kn" or "nk" for a tensor made by pack_linear_weight."""
    return "kn" if packed.is_contiguous() else "nk"


@torch.no_grad()
def pack_linear_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear weight ``[N, K]`` -> (int8 ``[K, N]``, fp32 scales ``[N]``): symmetric
    per-output-channel round-to-nearest, scale = max|w_n| / 127."""
    if w.dim() != 2:
        raise LoweringError(f"pack_linear_weight_int8: expected a 2-D [N, K] weight, got {tuple(w.shape)}")
    w = w.detach().to(torch.float32)
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.t().contiguous(), scales.contiguous()


def linear_f32(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``packed_weight = pack_linear_weight(W)``."""
    ensure_loaded()
    return torch.ops.kiln.linear_f32(x, packed_weight, bias)


def linear_f32_panels(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``panels = pack_linear_weight(W, "panels")``."""
    ensure_loaded()
    return torch.ops.kiln.linear_f32_panels(x, panels, panel_width(panels.shape[1]), bias)


def linear_i8(
    x: torch.Tensor, packed_weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Weight-only int8 linear with ``(packed_weight, scales) = pack_linear_weight_int8(W)``."""
    ensure_loaded()
    return torch.ops.kiln.linear_i8(x, packed_weight, scales, bias)
