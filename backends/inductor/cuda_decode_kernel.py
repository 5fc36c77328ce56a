"""The Triton kernel of `kiln_cuda::decode_attention` (cuda_decode_attention.py): one program per
(row, kv head) does a decode step's whole attention block for the query heads of that kv head.

1. rope on the new key and on the group's queries (rotate-half over the first 2 * HALF dims of
   the head, the rest passing through), rounded to the activations' dtype as the unfused graph
   rounds them;
2. the new key and value written into the caches at the row's position;
3. attention over the slots the position sees (all earlier ones, or the last `window`), with an
   online softmax in f32 over blocks of BLOCK_S slots. The new token's own score and value come
   from registers, not from the slot just written, so no barrier between the write and the reads
   is needed; each program reads only slots up to its position (not the whole cache).

A long cache is split over SPLITS programs per (row, kv head), CHUNK slots each (flash-decoding):
each leaves its running max, sum and output in `partial`, and `combine_kernel` merges them. The
first split owns the new token (its score, value and the cache writes).

Imported only where Triton is (a CUDA machine, or tests running it under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, positions_ptr, out_ptr, partial_ptr,
    q_row, q_head, q_dim, k_row, k_head, k_dim, v_row, v_head, v_dim,
    cache_row, cache_head, cache_slot, table_row, positions_row,
    scale, window,
    GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    HALF: tl.constexpr, ROPE: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    owner = split == 0  # of the new token: its cache writes, score and value
    position = tl.load(positions_ptr + row * positions_row).to(tl.int32)
    d = tl.arange(0, DIM_PAD)
    in_dim = d < DIM
    g = tl.arange(0, GROUPS_PAD)
    in_group = g < GROUPS
    head = kv_head * GROUPS + g
    dtype = k_cache_ptr.dtype.element_ty

    k_new = tl.load(k_ptr + row * k_row + kv_head * k_head + d * k_dim, mask=in_dim, other=0.0).to(tl.float32)
    v_new = tl.load(v_ptr + row * v_row + kv_head * v_head + d * v_dim, mask=in_dim, other=0.0)
    q_at = q_ptr + row * q_row + head[:, None] * q_head
    q_mask = in_group[:, None] & in_dim[None, :]
    q = tl.load(q_at + d[None, :] * q_dim, mask=q_mask, other=0.0).to(tl.float32)
    if ROPE:
        rotated = d < 2 * HALF
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        lane = tl.where(first, d, d - HALF)
        cos = tl.load(cos_ptr + position * table_row + lane, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + position * table_row + lane, mask=rotated, other=0.0).to(tl.float32)
        sign = tl.where(first, -1.0, 1.0)
        k_partner = tl.load(
            k_ptr + row * k_row + kv_head * k_head + partner * k_dim, mask=rotated & in_dim, other=0.0
        ).to(tl.float32)
        k_new = k_new * cos + sign * k_partner * sin  # rotate-half: x1 cos - x2 sin | x2 cos + x1 sin
        q_partner = tl.load(q_at + partner[None, :] * q_dim, mask=q_mask & rotated[None, :], other=0.0)
        q = q * cos[None, :] + sign[None, :] * q_partner.to(tl.float32) * sin[None, :]
        q = q.to(q_ptr.dtype.element_ty).to(tl.float32)  # rope's output in the activations' dtype
    k_new = k_new.to(dtype)
    v_new = v_new.to(dtype)
    cache_at = row * cache_row + kv_head * cache_head
    tl.store(k_cache_ptr + cache_at + position * cache_slot + d, k_new, mask=in_dim & owner)
    tl.store(v_cache_ptr + cache_at + position * cache_slot + d, v_new, mask=in_dim & owner)

    # the new token first: the owner's running max, sum and output start from its score and value
    best = tl.where(owner, tl.sum(q * k_new.to(tl.float32)[None, :], axis=1) * scale, float("-inf"))
    total = tl.where(owner, tl.full([GROUPS_PAD], 1.0, tl.float32), 0.0)
    acc = tl.where(owner, tl.zeros([GROUPS_PAD, DIM_PAD], tl.float32) + v_new.to(tl.float32)[None, :], 0.0)
    first_slot = tl.maximum(position - window + 1, 0)  # `window`: the launcher's 2**30 where there is none
    last_slot = tl.minimum(position, split * CHUNK + CHUNK)  # exclusive; the position is the new token's
    s = tl.arange(0, BLOCK_S)
    start = tl.maximum(first_slot, split * CHUNK)
    while start < last_slot:  # a while loop: Triton's interpreter cannot range() over loaded bounds
        slot = start + s
        seen = slot < last_slot
        at = cache_at + slot[:, None] * cache_slot + d[None, :]
        kv_mask = seen[:, None] & in_dim[None, :]
        keys = tl.load(k_cache_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [GROUPS_PAD, BLOCK_S]
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        values = tl.load(v_cache_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        total = total * rescale + tl.sum(weights, axis=1)
        best = new_best
        start += BLOCK_S
    row_head = row * GROUPS * tl.num_programs(1) + head
    if SPLITS == 1:
        out = acc / total[:, None]
        tl.store(out_ptr + row_head[:, None] * DIM + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:  # [row x head, split, DIM + 2]: the output so far, its max, its sum
        at = partial_ptr + (row_head * SPLITS + split) * (DIM + 2)
        tl.store(at[:, None] + d[None, :], acc, mask=q_mask)
        tl.store(at + DIM, best, mask=in_group)
        tl.store(at + DIM + 1, total, mask=in_group)


@triton.jit
def combine_kernel(partial_ptr, out_ptr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
                   SPLITS_PAD: tl.constexpr):  # fmt: skip
    """One (row, query head)'s output from its splits' partial results."""
    row_head = tl.program_id(0)
    split = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    at = partial_ptr + (row_head * SPLITS + split) * (DIM + 2)
    in_split = split < SPLITS
    best = tl.load(at + DIM, mask=in_split, other=float("-inf"))
    total = tl.load(at + DIM + 1, mask=in_split, other=0.0)
    acc = tl.load(at[:, None] + d[None, :], mask=in_split[:, None] & (d < DIM)[None, :], other=0.0)
    weight = tl.exp(best - tl.max(best, axis=0))  # the first split's max is finite: it holds the new token
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + row_head * DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < DIM)
