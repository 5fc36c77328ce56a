"""What tinygrad's CPU device needs from the machine, and which of its code generators Kiln uses.

tinygrad 0.14's CPU device (runtime/ops_cpu.py) compiles its own queue-worker programs with
clang when it opens, whatever renderer then compiles the model's kernels: without a `clang`
on PATH (or a clang named by $CC) the device fails deep inside tinygrad with
"No such file or directory: 'clang'". `require_cpu_compiler` checks first and names the fix.

Which clang: $CC where set, else the newest versioned clang on PATH (clang-21 down to clang-15),
else `clang`. tinygrad runs $CC (read once per process) or `clang`; Kiln routes its compiles
through the chosen one instead (`install_chosen_compiler`) and keys tinygrad's disk cache of
compiled objects by it. Newer clangs allocate the registers of the products' unrolled tiles
better: on an AMD EPYC (Zen 4) clang 19 ran an 8-token fp32 step in 27.4 ms against clang 14's
35.6 (docs/backend-tinygrad.md).

Renderers of the CPU device: CLANG (C source, clang -O2 -march=native), LLVM (LLVM IR through
libLLVM, no subprocess per kernel), X86 (tinygrad's own assembler) and LVP (Mesa, not installed).
Kiln picks CLANG: the fastest here (see docs/backend-tinygrad.md for the measurements);
`KILN_TINYGRAD_RENDERER=llvm` or tinygrad's own `DEV=CPU:LLVM` pick another.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess

from kiln.ir.errors import KilnError

CLANG_INSTALL = "apt-get install -y clang"  # Debian/Ubuntu; macOS: xcode-select --install
VERSIONED_CLANGS = tuple(f"clang-{version}" for version in range(21, 14, -1))  # newest first
LLVM_INSTALL = "apt-get install -y llvm"
DEFAULT_RENDERER = "CLANG"
RENDERERS = ("CLANG", "LLVM", "X86")
LLVM_LIBRARIES = ("LLVM", *(f"LLVM-{v}" for v in range(21, 13, -1)))  # what tinygrad's autogen/llvm.py loads


class CompilerNotFoundError(KilnError):
    """The C compiler (or LLVM library) tinygrad's CPU device compiles with is not installed."""


class TinygradDeviceError(KilnError):
    """The device or renderer asked of the tinygrad backend is not one it supports."""


def cpu_compiler() -> str:
    """The compiler tinygrad's CPU device runs: $CC if set, else the newest versioned clang on
    PATH, else clang."""
    if "CC" in os.environ:
        return os.environ["CC"]
    return next((name for name in VERSIONED_CLANGS if shutil.which(name)), "clang")


def install_chosen_compiler() -> None:
    """Make tinygrad's clang compiles run `cpu_compiler()` (tinygrad itself runs $CC or `clang`),
    its disk cache of objects keyed by that compiler's name, all in this process (idempotent).

    tinygrad's compile workers are spawned interpreters: they would run its unpatched compile
    (plain `clang`, absent where clang-19 alone is installed) and miss the renderer hooks of
    kernel_opts and prefetch_loads, so tinygrad compiles serially here (PARALLEL=0).
    """
    from tinygrad.helpers import PARALLEL
    from tinygrad.runtime.support.compiler_cpu import ClangCompiler

    PARALLEL.value = 0
    if getattr(ClangCompiler, "kiln_compiler", False):
        return
    original_init = ClangCompiler.__init__

    def init(self, arch, cachekey="compile_clang_obj"):
        original_init(self, arch, f"{cachekey}_{os.path.basename(cpu_compiler())}")

    ClangCompiler.__init__ = init
    ClangCompiler.compile = compile_c
    ClangCompiler.kiln_compiler = True


# clang 19 on an AVX10 Xeon warns "+avx10.1-256; will be promoted to avx10.1-512" for every
# kernel under -march=native: noise on the user's terminal, the code unchanged. Older clangs do
# not know the warning's name, hence the first flag.
QUIET_WARNINGS = ("-Wno-unknown-warning-option", "-Wno-invalid-feature-combination")


def compile_c(self, src: str) -> bytes:
    """tinygrad 0.14's ClangCompiler.compile (C source to an ELF object), run by cpu_compiler()."""
    command = [cpu_compiler(), "-c", "-x", "c", "-O2", "-fPIC", "-ffreestanding", "-fno-math-errno", "-nostdlib"]
    command += ["-fno-ident", *QUIET_WARNINGS, f"--target={self.arch}-none-unknown-elf", *self.args, "-", "-o", "-"]
    return subprocess.check_output(command, input=src.encode("utf-8"))


def require_cpu_compiler() -> str:
    """The path of the clang tinygrad will run; CompilerNotFoundError naming the fix if absent."""
    compiler = cpu_compiler()
    if "clang" not in os.path.basename(compiler):
        raise CompilerNotFoundError(
            f"$CC is {compiler!r}, but tinygrad's CPU device passes clang-only flags (--target, vector "
            f"extensions) to $CC. Fix: unset CC, or set CC=clang ({CLANG_INSTALL})."
        )
    path = shutil.which(compiler)
    if path is None:
        raise CompilerNotFoundError(
            f"the tinygrad backend needs the C compiler {compiler!r}, which is not on PATH: tinygrad's CPU "
            f"device compiles every kernel with it. Fix: install it ({CLANG_INSTALL}; `make .venv` does "
            "this on Debian/Ubuntu), or use another backend, e.g. --backend inductor."
        )
    return path


def require_llvm_library() -> None:
    """CompilerNotFoundError unless a libLLVM that tinygrad's LLVM renderer can load is installed."""
    if not any(ctypes.util.find_library(name) for name in LLVM_LIBRARIES):
        raise CompilerNotFoundError(
            f"the LLVM renderer needs libLLVM (14 to 21), which is not installed. Fix: {LLVM_INSTALL}, "
            f"or use the default renderer ({DEFAULT_RENDERER})."
        )


def chosen_renderer() -> str:
    """The renderer name: KILN_TINYGRAD_RENDERER, else the one in tinygrad's DEV, else CLANG."""
    name = os.environ.get("KILN_TINYGRAD_RENDERER", "").upper()
    if not name and os.environ.get("DEV", "").upper().startswith("CPU:"):
        name = os.environ["DEV"].split(":")[1].upper()
    name = name or DEFAULT_RENDERER
    if name not in RENDERERS:
        raise TinygradDeviceError(f"unknown tinygrad CPU renderer {name!r}; use one of {', '.join(RENDERERS)}")
    return name


def configure_cpu_device(device: str = "cpu") -> str:
    """Check the toolchain and make tinygrad's CPU device with the chosen renderer the default.

    Returns the tinygrad device string ("CPU"). Safe to call more than once.
    """
    if device != "cpu":
        raise TinygradDeviceError(
            f"the tinygrad backend runs on the CPU only so far, not {device!r}; use device='cpu' or another backend"
        )
    require_cpu_compiler()
    install_chosen_compiler()
    renderer = chosen_renderer()
    if renderer == "LLVM":
        require_llvm_library()
    from tinygrad.helpers import DEV

    DEV.value = f"CPU:{renderer}"
    return "CPU"
