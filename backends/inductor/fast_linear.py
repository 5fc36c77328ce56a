"""Route fp32 `linear` nodes to Kiln's GEMV kernel (`torch.ops.kiln.linear_f32`, gemv_kernel.py).

Why: decode is one GEMV per weight per token, and Inductor leaves every linear as an extern MKL
call whose fp32 GEMV streams weights well below this machine's bandwidth; Kiln's AVX2/FMA kernel
streams them near it. The op is a torch custom op with a fake implementation, so torch.compile
and AOTInductor call it like any extern kernel (AOTI through its proxy executor), and prefill
(more than 8 rows) still runs one MKL GEMM inside the op.

The lowering packs each weight once, at lowering time (`pack_linear_weight`: a [K, N] copy the
kernel streams in eight slabs side by side); the artifact keeps the original [N, K] weight and a
load packs again. It declines (F.linear stays) when the weight is not an fp32 parameter, when the
CPU lacks AVX2/FMA or no C++ compiler can build the kernel (with a warning naming why), or when
`KILN_LINEAR_KERNEL=torch` asks for torch's own linear (for benchmarks comparing the two).
"""

from __future__ import annotations

import functools

import torch

from . import gemv_kernel
from .lower_to_fx import register_linear_lowering

ENV_SWITCH = "KILN_LINEAR_KERNEL"  # "kiln" (default) or "torch"


@functools.cache
def kernel_available() -> bool:
    """Whether the GEMV kernel is built and loaded here (it builds once, then it is cached)."""
    return gemv_kernel.kernel_loads(
        gemv_kernel.ensure_loaded, "Kiln's GEMV kernel is unavailable, linears run on torch's F.linear (slower decode)"
    )


def wanted() -> bool:
    return gemv_kernel.kernel_chosen(ENV_SWITCH, "Kiln's GEMV kernel", "F.linear")


def lower_linear_f32(b, node, args, attrs):
    """`linear(x, W, bias?)` -> `kiln.linear_f32(x, packed W, bias)` for an fp32 weight parameter."""
    weight = b.constant(args[1])
    x_type = node.inputs[0].type
    if not b.on_cpu or weight is None or weight.dim() != 2 or weight.dtype != torch.float32 or x_type.dtype != "f32":
        return None
    if not wanted() or not kernel_available():
        return None
    packed = b.add_constant(node.inputs[1].name + ".packed", gemv_kernel.pack_linear_weight(weight))
    return b.call(torch.ops.kiln.linear_f32, args[0], packed, args[2])


register_linear_lowering(lower_linear_f32)
