"""native_replay.c built once per machine and loaded: the C loop that replays a captured JIT's
kernels (cpu_graph.py) and splits `core_id` kernels over a pool of native threads.

Built with the C compiler tinygrad's CPU device already needs (toolchain.py) into
$XDG_CACHE_HOME/kiln (default ~/.cache/kiln), named by a hash of the source, so a changed source
builds again and a second process loads the first one's build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from .toolchain import require_cpu_compiler

SOURCE = Path(__file__).with_name("native_replay.c")
MAX_ARGS = 32  # native_replay.c's MAX_ARGS: kernels with more arguments replay from Python
LAUNCH = np.dtype([("fn", "<u8"), ("args", "<u8"), ("core_arg", "<i8"), ("pieces", "<i8")])  # launch_t


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"


@functools.cache
def library() -> ctypes.CDLL:
    """The built native_replay library (built now if this machine has not built this source)."""
    source = SOURCE.read_bytes()
    path = cache_dir() / f"native_replay-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as out:
            built = Path(out.name)
        try:
            command = [require_cpu_compiler(), "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", str(built)]
            subprocess.run(command, check=True, capture_output=True)
            built.replace(path)  # atomic: a concurrent build of the same source writes the same bytes
        finally:
            built.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))
    lib.pool_create.restype = ctypes.c_void_p
    lib.pool_create.argtypes = [ctypes.c_int]
    lib.pool_destroy.argtypes = [ctypes.c_void_p]
    lib.run_launches.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


class NativePool:
    """A native_replay pool of `threads - 1` workers (the calling thread is the last one)."""

    def __init__(self, threads: int):
        self.threads = threads
        self.handle = library().pool_create(threads) if threads > 1 else None

    def run(self, launches: np.ndarray) -> None:
        """Run the launch_t records in order (ctypes releases the GIL for the whole call)."""
        library().run_launches(self.handle, launches.ctypes.data, len(launches))

    def close(self) -> None:
        if self.handle is not None:
            library().pool_destroy(self.handle)
            self.handle = None
