"""`gathered_matmul_q` (quantized MoE experts, ir/ops/routing.py) on Inductor: each routed expert's
codes through Kiln's int8 or int4 kernel where they lie (`kiln::gathered_linear_q`,
gathered_matmul.cpp), one kernel call per routed expert with its rows together, so a decode step
reads only the routed experts' codes. The kernels and their conditions are linear_q's
(quantized_linear.py): per-channel int8 as linear_q8's panels or linear_i8's [K, N], each expert
repacked at lowering; int4 (K % 64 == 0, group_size 32 or a multiple of 64, integer or no zero
points) read as the IR stores it. Anything else gathers the routed experts' codes and dequantizes
only those (the reference, compiled by Inductor)."""

from __future__ import annotations

import torch

from kiln.ir.ops.routing import gathered_matmul_q_reference

from . import gathered_matmul
from .lower_to_fx import FX_LOWERINGS
from .quantized_linear import _kernels_wanted, int4_kernel_scales, int8_packed


def _int8_experts(b, node, args, group_size):
    from .fast_linear import kernel_available

    qweight, scales = b.constant(args[0]), b.constant(args[1])
    if qweight is None or scales is None or group_size != qweight.shape[2] or not kernel_available():
        return None
    flat_scales = b.add_constant(
        node.inputs[1].name + ".flat", scales.reshape(scales.shape[0], -1).float().contiguous()
    )
    form, packed = int8_packed(qweight)
    weight = b.add_constant(f"{node.inputs[0].name}.{form}", packed)
    return b.call(torch.ops.kiln.gathered_linear_q, weight, flat_scales, None, args[2], args[3], group_size, None)


def _int4_experts(b, node, args, group_size):
    if b.constant(args[1]) is None:
        return None
    k = node.inputs[3].type.shape[1]
    prepared = int4_kernel_scales(b, k, group_size, args[1], node.inputs[1].name, args[4])
    if prepared is None:
        return None
    f32_scales, decode_scales = prepared
    return b.call(
        torch.ops.kiln.gathered_linear_q, args[0], f32_scales, args[4], args[2], args[3], group_size, decode_scales
    )


def lower_gathered_matmul_q(b, node, args, attrs):
    """Kiln's int8 / int4 kernel per routed expert where it applies, else gather + dequantize."""
    bits, group_size = attrs["bits"], attrs["group_size"]
    if b.on_cpu and _kernels_wanted() and gathered_matmul.op_available():
        result = (_int8_experts if bits == 8 else _int4_experts)(b, node, args, group_size)
        if result is not None:
            return result
    return b.call(gathered_matmul_q_reference, *args, bits=bits, group_size=group_size)


FX_LOWERINGS["gathered_matmul_q"] = lower_gathered_matmul_q
