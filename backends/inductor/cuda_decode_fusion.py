"""Rewrites of a decode module (one token per row, its own copy of the graph: cuda_executable.py)
into Kiln's CUDA kernels: each attention block as one `kiln_cuda::decode_attention` call
(KILN_CUDA_DECODE_ATTENTION=fused), each product over a weight it holds as `kiln_cuda::gemv`
(KILN_CUDA_DECODE_LINEAR=triton: cuda_gemv.py).

The CUDA lowering spells a layer's attention as rope on q and k, two cache writes and
`grouped_attention`, which Inductor compiles to seven kernels a layer at one token per row
(bench/results/gpu-h200-profile.md). The attention rewrite:

    q = rotate_half(xq, cos, sin); k = rotate_half(xk, cos, sin)      (cos, sin = rope_rows(positions, ...))
    kc = kv_write_at(k_cache, k, index); vc = kv_write_at(v_cache, v, index)
    out = grouped_attention(q, kc, vc, positions, tree, scale, window, ...)
 -> out = decode_attention(xq, xk, v, k_cache, v_cache, cos_table, sin_table, positions, scale, window)

Without a rope of that form (learned positions, a rope the pass does not recognise) q and k go
in as they are and the op applies none. The token tree is dropped: with one token per row a
query sees its own slot whatever the tree says.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from kiln.ir.ops.quantized import linear_q_reference

from . import composite_ops
from .cuda_decode_attention import decode_attention  # noqa: F401 - registers torch.ops.kiln_cuda
from .cuda_gemv import gemv  # noqa: F401 - registers torch.ops.kiln_cuda.gemv
from .cuda_lowerings import grouped_attention, linear_int4_cuda, linear_int8_channels
from .layer_regions import attribute_of

FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32)


def _call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _rope_input(node: fx.Node):
    """(x, rope_rows node) where node is x's rope (rotate_half by a rope_rows pair, maybe cast
    back to x's dtype), else None."""
    if node.op == "call_method" and node.target == "to" and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if not _call(node, composite_ops.rotate_half):
        return None
    x, cos, sin = node.args
    if not (_call(cos, operator.getitem) and _call(sin, operator.getitem)) or cos.args[0] is not sin.args[0]:
        return None
    if (cos.args[1], sin.args[1]) != (0, 1) or not _call(cos.args[0], composite_ops.rope_rows):
        return None
    return x, cos.args[0]


def _cache_write(node) -> tuple | None:
    """(cache, new, index) of an in-place cache write that only the attention reads, else None."""
    if not _call(node, composite_ops.kv_write_at) or len(node.users) != 1:
        return None
    cache, new, index = node.args
    return (cache, new, index) if cache.op == "get_attr" and _call(index, composite_ops.kv_write_index) else None


def fuse_decode_attention(module: fx.GraphModule) -> int:
    """Rewrite `module` (a decode module: one token per row) in place; returns how many
    attention blocks became one call."""
    graph, fused = module.graph, 0
    for node in list(graph.nodes):
        if not _call(node, grouped_attention):
            continue
        q, k_write, v_write, positions, _tree, scale, window = node.args[:7]
        k_parts, v_parts = _cache_write(k_write), _cache_write(v_write)
        if k_parts is None or v_parts is None or k_parts[2] is not v_parts[2] or k_parts[2].args[1] is not positions:
            continue
        (k_cache, k, _), (v_cache, v, _) = k_parts, v_parts
        q_rope, k_rope = _rope_input(q), _rope_input(k)
        tables = (None, None)
        if q_rope and k_rope and q_rope[1] is k_rope[1] and q_rope[1].args[0] is positions:
            (q, rows), (k, _) = q_rope, k_rope
            tables = rows.args[1], rows.args[2]
        with graph.inserting_before(node):
            call = graph.call_function(
                torch.ops.kiln_cuda.decode_attention.default,
                (q, k, v, k_cache, v_cache, *tables, positions, float(scale), int(window)),
            )
        replaced = (node.args[0], k_write.args[1], k_write.args[2])  # the ropes the call took over, the index
        node.replace_all_uses_with(call)
        for dead in (node, k_write, v_write):
            graph.erase_node(dead)
        _erase_unused(graph, replaced)
        fused += 1
    module.recompile()
    return fused


PURE = (composite_ops.rotate_half, composite_ops.rope_rows, composite_ops.kv_write_index, operator.getitem)


def _erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase the rope and index nodes among `nodes` (and what they read) that nothing reads now. Not the
    graph's own dead-code pass: it would take an in-place write nobody reads for dead too."""
    pending = list(nodes)
    while pending:
        node = pending.pop()
        pure = any(_call(node, fn) for fn in PURE) or (node.op == "call_method" and node.target == "to")
        if pure and not node.users:
            pending += list(node.all_input_nodes)
            graph.erase_node(node)


def use_triton_gemv(module: fx.GraphModule) -> int:
    """Rewrite `module` in place: each product over a weight the module holds calls Kiln's Triton
    GEMV (cuda_gemv.py): `F.linear` over a half or f32 weight, the per-channel int8 form, and
    4-bit codes (tinygemm's form or the dequantized one); a weight computed in the graph keeps
    its form. Returns how many products were rewritten."""
    rewritten = 0
    for node in module.graph.nodes:
        call = _gemv_call(node)
        if call is not None:
            node.target, node.args, node.kwargs = call
            rewritten += 1
    module.recompile()
    return rewritten


def _gemv_call(node: fx.Node) -> tuple | None:
    """(target, args, kwargs) of the GEMV that computes `node`, or None."""
    if _call(node, F.linear) and _held(node.args[1]):
        weight = attribute_of(node.args[1])
        if weight.dim() != 2 or weight.dtype not in FLOAT_WEIGHTS or weight.stride(1) != 1:
            return None
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return torch.ops.kiln_cuda.gemv.default, (node.args[0], node.args[1], None, bias), {}
    if _call(node, linear_int8_channels) and _held(node.args[1]):
        return torch.ops.kiln_cuda.gemv.default, tuple(node.args), {}
    if _call(node, linear_int4_cuda) and _held(node.args[3]):
        x, _, _, qweight, scales, zeros, bias, group_size = node.args
        return torch.ops.kiln_cuda.gemv_int4.default, (x, qweight, scales, zeros, bias, group_size), {}
    if _call(node, linear_q_reference) and node.kwargs.get("bits") == 4 and _held(node.args[1]):
        x, qweight, scales, zeros, bias = node.args
        return torch.ops.kiln_cuda.gemv_int4.default, (x, qweight, scales, zeros, bias, node.kwargs["group_size"]), {}
    return None


def _held(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"
