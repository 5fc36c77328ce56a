"""`kiln_cuda::decode_attention`: a decode step's attention block (rope on the new query and key,
the key and value written into the caches, GQA attention over the slots the position sees) as
one kernel on a GPU, where the unfused graph runs seven (two ropes, two cache writes, two
matmuls and a softmax: bench/results/gpu-h200-profile.md).

On CUDA it launches the Triton kernel of cuda_decode_kernel.py; elsewhere it runs its definition
in torch ops, the unfused graph's with scores and rope in f32 as the kernel computes them (the
reference the kernel is tested against, and what the CUDA lowering tested on the CPU runs).
Being a custom op that mutates the caches, it reaches Inductor as one opaque call
(auto-functionalized, then written in place again: the caches are not copied), which a CUDA
graph captures like any kernel.

cuda_decode_fusion.py puts it in a decode module's graph where KILN_CUDA_DECODE_ATTENTION=fused.
"""

from __future__ import annotations

import torch

from .composite_ops import kv_write_at, kv_write_index, rope_rows, rotate_half

NO_WINDOW = 1 << 30  # the kernel's window where every earlier slot is seen
SPLIT_ABOVE = 2048  # slots of a cache above which each (row, kv head) is split over programs
CHUNK = 512  # slots a split walks (a 32k cache: 64 programs per kv head)
SCORE_TILE = 1 << 14  # products a loop step holds ([groups, slots, head dim] in f32, over 128 threads)


def decode_attention_reference(q, k, v, k_cache, v_cache, cos_table, sin_table, positions, scale, window):
    """The unfused graph's ops in f32: rope (where tables are given), kv_write into both caches,
    then attention of each query over slots up to its position (and within the window), GQA
    grouped, rounded to q's dtype at the end."""
    if cos_table is not None:  # in f32, rounded once (as Inductor computes the unfused graph's rope)
        cos, sin = rope_rows(positions, cos_table.float(), sin_table.float())
        q, k = rotate_half(q.float(), cos, sin).to(q.dtype), rotate_half(k.float(), cos, sin).to(k.dtype)
    index = kv_write_index(k, positions)
    kv_write_at(k_cache, k, index)
    kv_write_at(v_cache, v, index)
    batch, heads, _, dim = q.shape
    keys, values = k_cache[:batch], v_cache[:batch]
    kv_heads, slots = keys.size(1), keys.size(2)
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).float()
    scores = torch.matmul(grouped, keys.float().transpose(-1, -2)) * scale  # [batch, kv_heads, groups, slots]
    slot = torch.arange(slots, device=q.device)
    position = positions[:, :1, None, None]
    seen = (slot <= position) & (slot > position - (window or NO_WINDOW))
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    out = torch.matmul(probs, values.float())
    return out.reshape(batch, heads, 1, dim).to(q.dtype)


@torch.library.custom_op("kiln_cuda::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cos_table: torch.Tensor | None,
    sin_table: torch.Tensor | None,
    positions: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Attention of q [batch, heads, 1, dim] (before rope) with k, v [batch, kv_heads, 1, dim]
    written into the caches [rows, kv_heads, slots, dim] at positions [batch, 1]; the output is
    [batch, heads, 1, dim] in q's dtype."""
    if q.is_cuda:
        return launch_decode_attention(q, k, v, k_cache, v_cache, cos_table, sin_table, positions, scale, window)
    return decode_attention_reference(q, k, v, k_cache, v_cache, cos_table, sin_table, positions, scale, window)


@decode_attention.register_fake
def _decode_attention_shape(q, k, v, k_cache, v_cache, cos_table, sin_table, positions, scale, window):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def launch_decode_attention(
    q, k, v, k_cache, v_cache, cos_table, sin_table, positions, scale, window,
    chunk: int | None = None, block_s: int | None = None, num_warps: int | None = None,
):  # fmt: skip
    """The Triton kernel over a (row, kv head, split) grid; any device Triton runs on: a GPU, or
    the CPU under TRITON_INTERPRET=1 (the tests). A cache of more than SPLIT_ABOVE slots is split
    in chunks of CHUNK slots (or `chunk`, the tests' choice) and the splits combined. `block_s`
    (slots a loop step) and `num_warps` override the defaults (bench/gpu_kernels.py times them)."""
    import triton

    from .cuda_decode_kernel import combine_kernel, decode_attention_kernel

    batch, heads, _, dim = q.shape
    kv_heads = k.size(1)
    if k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("decode_attention needs both caches laid out alike with the head dim contiguous")
    out = torch.empty((batch, heads, 1, dim), dtype=q.dtype, device=q.device)
    half = 0 if cos_table is None else cos_table.size(1)
    table = cos_table if cos_table is not None else q  # unread without rope (ROPE=False)
    groups = heads // kv_heads
    groups_pad, dim_pad = triton.next_power_of_2(groups), triton.next_power_of_2(dim)
    block_s = block_s or min(64, max(8, SCORE_TILE // (groups_pad * dim_pad)))  # [groups, slots, dim] in registers
    slots = k_cache.size(2)
    chunk = chunk or (CHUNK if slots > SPLIT_ABOVE else NO_WINDOW)
    splits = triton.cdiv(slots, chunk)
    partial = torch.empty((batch * heads, splits, dim + 2), dtype=torch.float32, device=q.device) if splits > 1 else out
    decode_attention_kernel[(batch, kv_heads, splits)](
        q, k, v, k_cache, v_cache, table, sin_table if sin_table is not None else table, positions, out, partial,
        q.stride(0), q.stride(1), q.stride(3), k.stride(0), k.stride(1), k.stride(3),
        v.stride(0), v.stride(1), v.stride(3),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table.stride(0), positions.stride(0),
        float(scale), int(window) or NO_WINDOW,
        GROUPS=groups, GROUPS_PAD=groups_pad, DIM=dim, DIM_PAD=dim_pad,
        HALF=half, ROPE=cos_table is not None, BLOCK_S=block_s, SPLITS=splits, CHUNK=chunk,
        **({} if num_warps is None else {"num_warps": num_warps}),  # Triton's default: 4
    )  # fmt: skip
    if splits > 1:
        combine_kernel[(batch * heads,)](
            partial, out, DIM=dim, DIM_PAD=dim_pad, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits)
        )
    return out
