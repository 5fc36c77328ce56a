"""The inductor backend: Kiln IR -> torch.fx -> Inductor.

- `lower(graph, options)` compiles just in time with torch.compile (executable.py);
- `executable.save(directory)` writes an AOTInductor package, and `load(directory, graph, weights,
  options)` runs it without tracing or compiling (aoti_package.py);
- a graph for a CUDA device is saved without a package and compiled where it is loaded, decode
  steps replayed as CUDA graphs (cuda_executable.py);
- a tensor-parallel graph (collectives.py) is saved without a package and compiled with
  torch.compile when loaded in each rank. A package can carry the collectives (traced under a
  fake process group it builds, and runs right), but under gloo it intermittently deadlocks
  inside its collectives (torch 2.13, CPU), so sharded artifacts are compiled at load;
- lower_to_fx.py holds the one table from IR op to torch call (`FX_LOWERINGS`), and the hook for
  custom linear kernels (`register_linear_lowering`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.backends.errors import FeedError, LoweringError
from kiln.ir.errors import OptionError, UnsupportedOpError
from kiln.ir.ops.collectives import tensor_parallel_size

# imported for what they register: Kiln's cached-attention kernel for attention over KV buffers,
# and its GEMV kernel as the lowering of fp32 linears
from . import cuda_lowerings, fast_attention, fast_linear, gathered_matmul, gathered_matmul_q  # noqa: F401
from .aoti_package import PACKAGE_FILE, PACKAGE_INFO_FILE, AOTIExecutable, PackageError
from .aoti_package import load as load_package
from .cuda_executable import CudaInductorExecutable, lower_for_cuda
from .executable import InductorExecutable
from .executable import lower as lower_for_cpu
from .lower_to_fx import (
    FX_LOWERINGS,
    check_lowering_table,
    graph_to_fx,
    register_attention_lowering,
    register_linear_lowering,
)

NAME = "inductor"


def backend_version() -> str:
    """Inductor is part of torch: its version is torch's."""
    return torch.__version__


def on_cuda(options) -> bool:
    return options.device.split(":")[0] == "cuda"


def lower(graph, options):
    """The executable of a graph with its weights: for the CPU compiled now, for CUDA where a GPU is."""
    return lower_for_cuda(graph, options) if on_cuda(options) else lower_for_cpu(graph, options)


def load(directory, graph, weights, options):
    """The executable of an artifact: its AOTInductor package; for a tensor-parallel graph a
    just-in-time compile of this rank's shard (the package path cannot carry all_gather); for a
    CUDA device a compile on that device (and an artifact compiled for CUDA, which has no package,
    loaded on the CPU: compile_here_for_cpu)."""
    if on_cuda(options):
        return CudaInductorExecutable(graph, options, weights)
    if tensor_parallel_size(graph) > 1:
        return InductorExecutable(graph, options, weights)
    if not (Path(directory) / PACKAGE_INFO_FILE).is_file() and not (Path(directory) / PACKAGE_FILE).is_file():
        return compile_here_for_cpu(directory, graph, weights, options)  # compiled for CUDA
    return load_package(directory, graph, weights, options)


def compile_here_for_cpu(directory, graph, weights, options):
    """An artifact compiled for CUDA (no package) loaded on the CPU: an f32 graph is compiled here
    just in time; a half-precision one is refused (CPUs without native f16/bf16 run it far slower)."""
    dtypes = {v.type.dtype for v in graph.params.values()}
    if dtypes & {"f16", "bf16"}:
        raise OptionError(
            f"{directory} was compiled for a GPU in {'/'.join(sorted(dtypes & {'f16', 'bf16'}))}, which this "
            "CPU would run far slower than f32. Fix: load it with device='cuda' on a GPU machine, or "
            "compile the model again with device='cpu' (dtype='f32')."
        )
    return InductorExecutable(graph, options, weights)


__all__ = [
    "FX_LOWERINGS",
    "NAME",
    "AOTIExecutable",
    "CudaInductorExecutable",
    "FeedError",
    "InductorExecutable",
    "LoweringError",
    "PackageError",
    "UnsupportedOpError",
    "backend_version",
    "check_lowering_table",
    "graph_to_fx",
    "load",
    "lower",
    "register_attention_lowering",
    "register_linear_lowering",
]
