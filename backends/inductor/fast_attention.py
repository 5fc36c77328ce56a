"""Route `attention` over a static KV cache to Kiln's kernel (`torch.ops.kiln.cached_attention`).

Why: Inductor decomposes a grouped, position-masked attention into copies of k and v for every
query head and scores over every slot of the buffer, each decode step (attention_kernel.py says
what that cost). The kernel reads each kv head once, only up to each query's position.

It takes the stateful form: positions given (a token tree too), no extra mask, no softcap or ALiBi,
f32 q with an f32 cache or an int8 one (codes and scales). Otherwise,
when the CPU or compiler cannot build the kernel (warned once), or when
`KILN_ATTENTION_KERNEL=torch` asks for the decomposed one (benchmarks comparing the two), the
composite `scaled_dot_product_attention` lowering stays.
"""

from __future__ import annotations

import functools

import torch

from . import attention_kernel, gemv_kernel
from .composite_ops import scale_and_positions
from .lower_to_fx import register_attention_lowering

ENV_SWITCH = "KILN_ATTENTION_KERNEL"  # "kiln" (default) or "torch"


@functools.cache
def kernel_available() -> bool:
    return gemv_kernel.kernel_loads(
        attention_kernel.ensure_loaded,
        "Kiln's attention kernel is unavailable, attention runs decomposed by Inductor (slower decode)",
    )


def wanted() -> bool:
    return gemv_kernel.kernel_chosen(ENV_SWITCH, "Kiln's attention kernel", "decomposed SDPA")


def lower_cached_attention(b, node, args, attrs):
    """attention(q, k, v, positions, tree?, k_scales?, v_scales?) -> kiln.cached_attention(q, k, v,
    positions, scale, window, tree, k_scales, v_scales); over `kv_pages` of a paged cache's pools,
    the pools and their block table (the gather is then dead code)."""
    q, k, v, mask, positions, tree, k_scales, _ = node.inputs
    if not b.on_cpu or mask is not None or positions is None or attrs["softcap"] or attrs["alibi"]:
        return None
    cache_dtype = "i8" if k_scales is not None else "f32"
    if q.type.dtype != "f32" or k.type.dtype != cache_dtype or v.type.dtype != cache_dtype:
        return None
    if not isinstance(q.type.shape[3], int):
        return None
    if not wanted() or not kernel_available():
        return None
    scale, position_ids = scale_and_positions(b, node, args, attrs)
    caches, optional = args[1:3], list(args[5:8] if k_scales is not None else [args[5]] if tree is not None else [])
    if k.producer is not None and k.producer.op == "kv_pages":  # the kernel reads the pools through the table
        table = args[1].args[1]
        caches = [args[1].args[0], args[2].args[0]]
        scales = [args[6].args[0], args[7].args[0]] if k_scales is not None else [None, None]
        optional = [args[5], *scales, table]
    return b.call(
        torch.ops.kiln.cached_attention,
        args[0],
        *caches,
        position_ids,
        scale,
        int(attrs["window"] or 0),
        *optional,
    )


register_attention_lowering(lower_cached_attention)
