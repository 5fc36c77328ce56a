"""`gathered_matmul` on Inductor: each routed row multiplied by its expert's matrix where it lies
(gathered_matmul.cpp), where Inductor's own lowering of `weights[ids] @ x` copies every routed
expert's matrix first. Experts that are an fp32 parameter are packed at lowering for Kiln's GEMV
kernel (`kiln::gathered_linear`: one kernel call per routed expert, its rows together); others go
through BLAS in place (`kiln::gathered_matmul`). Where the ops cannot be built (warned once), the
composite form stays. Quantized experts (`gathered_matmul_q`): gathered_matmul_q.py."""

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

    @torch.library.register_fake("kiln::gathered_linear")
    def _gathered_linear_fake(packed, ids, x):
        return x.new_empty((x.shape[0], packed.shape[2], x.shape[2]), dtype=packed.dtype)

    @torch.library.register_fake("kiln::gathered_linear_q")
    def _gathered_linear_q_fake(weight, scales, zeros, ids, x, group_size, decode_scales=None):
        return x.new_empty((x.shape[0], scales.shape[1], x.shape[2]), dtype=torch.float32)


def ensure_loaded() -> None:
    """Build (once, cached) and load the ops; registers torch.ops.kiln.gathered_matmul,
    gathered_linear (which calls Kiln's GEMV kernel, loaded first) and gathered_linear_q (which
    calls the int8 / int4 kernel its weights need, loaded before its first call). Idempotent."""
    gemv_kernel.ensure_loaded()
    gemv_kernel.load_extension(_SRC, "KILN_GATHERED_MATMUL_KERNELS", "kiln_gathered_matmul", _register_fake)


@functools.cache
def op_available() -> bool:
    return gemv_kernel.kernel_loads(
        ensure_loaded, "Kiln's gathered_matmul is unavailable, MoE experts are gathered into copies"
    )


def _composite(weights: torch.Tensor, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(weights[ids], x.to(weights.dtype))


def lower_gathered_matmul(b, node, args, attrs):
    """Experts packed for Kiln's GEMV kernel where they are an fp32 parameter, else Kiln's
    BLAS-backed op, else the composite gather."""
    if not b.on_cpu or node.inputs[0].type.dtype != "f32" or not op_available():
        return b.call(_composite, *args)
    weights = b.constant(args[0])
    if weights is not None and weights.dim() == 3 and weights.dtype == torch.float32:
        packed = b.add_constant(node.inputs[0].name + ".packed", weights.detach().transpose(1, 2).contiguous())
        return b.call(torch.ops.kiln.gathered_linear, packed, args[1], args[2])
    return b.call(torch.ops.kiln.gathered_matmul, *args)


FX_LOWERINGS["gathered_matmul"] = lower_gathered_matmul
