"""Kiln's attention over a static KV cache for the CPU: `torch.ops.kiln.cached_attention`.

    from kiln.backends.inductor import attention_kernel
    attention_kernel.ensure_loaded()
    out = torch.ops.kiln.cached_attention(q, k_cache, v_cache, positions, scale, window, tree=None)
    out = torch.ops.kiln.cached_attention(q, k_codes, v_codes, positions, scale, window, tree, k_scales, v_scales)

q [batch, heads, seq, head_dim], caches [max_batch, kv_heads, slots, head_dim] (rows [0, batch)
read), positions [batch, seq]: query (b, t) sees slots in (positions[b, t] - window,
positions[b, t]] (window 0: from slot 0), query head h reads kv head h // (heads // kv_heads);
a token tree (bool [batch, seq, seq]) hides the call's own slots positions[b, 0] + j where
tree[b, t, j] is False (see the IR's attention). An int8 cache (ir/ops/kv_quant.py) passes its
codes as the caches and its scales [max_batch, kv_heads, slots, 1]: each row is converted to f32
inside the dot products, so no dequantized copy of the cache is made. A paged cache passes its
pools [num_blocks, kv_heads, block_size, head_dim] and `block_table` (int32 [batch, blocks_per_row]).
Why a kernel of Kiln's own: decomposed by Inductor, a grouped attention over a static cache copies
k and v out to every query head and scores every slot of the buffer on every decode step; this one
reads each kv head once and only the slots up to the position (attention_kernel.cpp). Built like
gemv_kernel.py (same compiler, flags and cache directory), with a fake implementation for
torch.compile / AOTInductor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import gemv_kernel

_SRC = Path(__file__).with_name("attention_kernel.cpp")
# kFewQueries in attention_kernel.cpp: a row of at most this many queries runs the kernel that
# decodes, so its positions equal one-token calls bit for bit; more run ATen's SDPA (other rounding)
FEW_QUERIES = 16


def _register_fake() -> None:
    @torch.library.register_fake("kiln::cached_attention")
    def _cached_attention_fake(
        q, k, v, positions, scale, window, tree=None, k_scales=None, v_scales=None, block_table=None
    ):
        return q.new_empty((*q.shape[:3], v.shape[3]))


def ensure_loaded() -> None:
    """Build (once, cached) and load the kernel; registers torch.ops.kiln.cached_attention. Idempotent."""
    gemv_kernel.load_extension(_SRC, "KILN_ATTENTION_KERNELS", "kiln_attention", _register_fake)
