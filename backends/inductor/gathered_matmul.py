"""`gathered_matmul` on Inductor: Kiln's op (`torch.ops.kiln.gathered_matmul`, gathered_matmul.cpp)
multiplies each routed row by its expert's matrix where it lies, rows sharing an expert in one
BLAS product; Inductor's own lowering of `weights[ids] @ x` copies every routed expert's matrix
first. Where the op cannot be built (warned once), the composite form stays."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import gemv_kernel
from .lower_to_fx import FX_LOWERINGS

_SRC = Path(__file__).with_name("gathered_matmul.cpp")


def _register_fake() -> None:
    @torch.library.register_fake("kiln::gathered_matmul")
    def _gathered_matmul_fake(weights, ids, x):
        return x.new_empty((x.shape[0], weights.shape[1], x.shape[2]), dtype=weights.dtype)


def ensure_loaded() -> None:
    """Build (once, cached) and load the op; registers torch.ops.kiln.gathered_matmul. Idempotent."""
    gemv_kernel.load_extension(_SRC, "KILN_GATHERED_MATMUL_KERNELS", "kiln_gathered_matmul", _register_fake)


@functools.cache
def op_available() -> bool:
    return gemv_kernel.kernel_loads(
        ensure_loaded, "Kiln's gathered_matmul is unavailable, MoE experts are gathered into copies"
    )


def _composite(weights: torch.Tensor, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(weights[ids], x.to(weights.dtype))


def lower_gathered_matmul(b, node, args, attrs):
    if node.inputs[0].type.dtype == "f32" and op_available():
        return b.call(torch.ops.kiln.gathered_matmul, *args)
    return b.call(_composite, *args)


FX_LOWERINGS["gathered_matmul"] = lower_gathered_matmul
