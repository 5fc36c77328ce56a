"""tinygrad on a GPU: its CUDA device (NVRTC-compiled kernels, launched through libcuda).

The backend's CPU work (interleaved and packed weight layouts, hand-coded kernel loops, the
native replay of a step's kernels, clang's vector types) is for tinygrad's CPU device; on a GPU
the graph is lowered as written, with weights in their plain layout, and tinygrad's own
optimizer chooses each kernel's grid, local memory and unrolling. Where a machine has no GPU
(or tinygrad cannot open its CUDA device), compiling for one keeps the IR and weights for the
GPU to build from when the artifact is loaded there (`CompiledWhereLoaded`).

`GPU_DEVICE` names the tinygrad device a `device="cuda"` executable runs on. The tests set it
to tinygrad's Python emulator of a CUDA GPU (`PYTHON::sm_80`), which runs the same kernels,
with their grids and local memory, on the CPU.
"""

from __future__ import annotations

from kiln.backends.executable import BackendOptions
from kiln.ir import Graph

from .toolchain import TinygradDeviceError

GPU_DEVICE = "CUDA"


def on_gpu(options: BackendOptions) -> bool:
    return options.device.split(":")[0] == "cuda"


def open_gpu_device(device: str) -> str:
    """Make tinygrad's GPU device the default for what follows; returns its name. Raises
    TinygradDeviceError naming the fix where it cannot open here."""
    from tinygrad import Device
    from tinygrad.helpers import DEV

    if device not in ("cuda", "cuda:0"):
        raise TinygradDeviceError(
            f"the tinygrad backend runs on one GPU, 'cuda' (or 'cuda:0'), not {device!r}. Fix: device='cuda'"
        )
    try:
        Device[GPU_DEVICE]
    except Exception as error:  # noqa: BLE001 - tinygrad raises whatever its driver bindings raise
        raise TinygradDeviceError(
            f"tinygrad cannot open its {GPU_DEVICE} device here ({type(error).__name__}: {error}). Fix: load "
            "the artifact on a machine with an NVIDIA GPU, its driver (libcuda) and NVRTC (CUDA_PATH "
            "pointing at a CUDA toolkit, or the nvidia-cuda-nvrtc package)"
        ) from None
    DEV.value = GPU_DEVICE
    return GPU_DEVICE


def gpu_device_opens() -> bool:
    try:
        open_gpu_device("cuda")
    except TinygradDeviceError:
        return False
    return True


class CompiledWhereLoaded:
    """What compiling for a GPU gives where tinygrad cannot open one: the artifact's IR and
    weights, and tinygrad.json; the GPU it is loaded on builds the steps."""

    def __init__(self, graph: Graph, options: BackendOptions, prefill_chunk: int):
        from .weight_layouts import WeightLayouts

        self.graph, self.options, self.prefill_chunk = graph, options, prefill_chunk
        self.layouts = WeightLayouts({})  # a GPU's weights keep their plain layout

    def run(self, *args, **kwargs):
        open_gpu_device(self.options.device)
        raise TinygradDeviceError("load the artifact (kiln.load) to run it on the GPU")

    def save(self, directory) -> list[str]:
        from .artifact_files import write_backend_info

        return write_backend_info(directory, self)
