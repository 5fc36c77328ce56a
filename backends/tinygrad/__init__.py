"""The tinygrad backend: Kiln IR -> tinygrad Tensor operations under TinyJit, on the CPU device
(or tinygrad's CUDA device for device="cuda": gpu_device.py).

- `lower(graph, options)` builds the executable (executable.py): realized weights and KV
  buffers, decode and prefill steps as separate TinyJit functions with the cache positions as
  bound symbolic Variables;
- op_lowerings.py holds the one table from IR op to Tensor operations (`TENSOR_LOWERINGS`),
  cache_attention.py the in-place `kv_write` and the attention over the written keys;
- cpu_graph.py replays jitted kernels on all cores; toolchain.py checks for the C compiler
  tinygrad's CPU device needs and picks the newest clang; kernel_opts.py, wide_loads.py and
  prefetch_loads.py shape the CPU kernels (loop optimizations, vector widths, prefetches);
  artifact_files.py saves and loads (`load(directory, ...)`).
"""

from __future__ import annotations

from kiln.backends.errors import FeedError
from kiln.ir.errors import UnsupportedOpError

from .artifact_files import TinygradArtifactError, load, tinygrad_version
from .executable import TinygradExecutable, compiled_program_count, lower
from .op_lowerings import TENSOR_LOWERINGS, check_lowering_table
from .toolchain import CompilerNotFoundError, TinygradDeviceError, install_chosen_compiler, require_cpu_compiler

# Before tinygrad opens its CPU device (which compiles helper programs): with Kiln imported, every
# tinygrad compile in this process runs the chosen clang, wherever the device gets opened from.
install_chosen_compiler()
NAME = "tinygrad"


def backend_version() -> str:
    """The installed tinygrad's version."""
    return tinygrad_version()


__all__ = [
    "NAME",
    "TENSOR_LOWERINGS",
    "CompilerNotFoundError",
    "FeedError",
    "TinygradArtifactError",
    "TinygradDeviceError",
    "TinygradExecutable",
    "UnsupportedOpError",
    "backend_version",
    "check_lowering_table",
    "compiled_program_count",
    "load",
    "lower",
    "require_cpu_compiler",
]
