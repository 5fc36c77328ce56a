"""Attention and the static KV cache's write.

`attention(q, k, v, mask?, positions?, tree?, k_scales?, v_scales?)`: q is [batch, q_heads, seq,
head_dim], k/v are [kv_batch, kv_heads, keys, head_dim] with q_heads a multiple of kv_heads (GQA
kept grouped) and kv_batch >= batch (a static cache has max_batch rows; the first `batch` are read).
With `k_scales` and `v_scales` (f32 [kv_batch, kv_heads, keys, 1]), k and v are an int8 cache's
codes (see kv_quant.py): key slot s is k[s] * k_scales[s], value slot s likewise.
Which keys a query sees:
- `positions` given (the stateful form): key slot s is visible to query (b, t) when
  s <= positions[b, t], and, with a sliding `window`, s > positions[b, t] - window;
- else `causal`: the usual lower-triangular mask aligned to the last key;
- `mask` (bool: True = visible, or float: added to scores) narrows it further;
- `tree` (bool [batch, seq, seq], with `positions`: the key slots of this call's own tokens, where
  they are contiguous from positions[b, 0]) narrows it among this call's tokens: query t sees the
  slot of token j, positions[b, 0] + j, only where tree[b, t, j]. A token tree verified in one
  step passes each token's ancestors (and itself); a lower-triangular `tree` changes nothing.
`softcap` > 0 applies softcap * tanh(scores / softcap) before masking (Gemma 2 style).
`alibi` (one slope per query head, or empty) then adds slope * (key slot - query position) to
the scores, ALiBi's linear bias (BLOOM, MPT); the query position is positions[b, t] when given,
else t + keys - seq (the last query at the last key). Softmax ignores a constant per row, so
this equals the models' own slope * key slot.
"""

import math

import torch

from ..dims import dims_equal
from ..registry import OpDef, OpError, register
from .kv_quant import dequantize_kv
from .paged_kv import check_block_table, paged_write_index


def _attention_infer(
    q, k, v, mask, positions, tree, k_scales=None, v_scales=None, *, scale, causal, window, softcap, alibi=()
):
    _check_int8_cache(k, v, k_scales, v_scales, positions)
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise OpError("attention: q, k, v must be [batch, heads, seq, head_dim]")
    q_heads, kv_heads = q.shape[1], k.shape[1]
    if isinstance(q_heads, int) and isinstance(kv_heads, int) and q_heads % kv_heads:
        raise OpError(f"attention: {q_heads} query heads are not a multiple of {kv_heads} kv heads")
    if not dims_equal(q.shape[3], k.shape[3]):
        raise OpError("attention: q and k head dims differ")
    if positions is not None and positions.dtype not in ("i64", "i32"):
        raise OpError("attention: positions must be integers")
    if tree is not None and (positions is None or tree.dtype != "bool" or tree.rank != 3):
        raise OpError("attention: tree must be bool [batch, seq, seq] beside positions")
    if alibi and isinstance(q_heads, int) and len(alibi) != q_heads:
        raise OpError(f"attention: {len(alibi)} ALiBi slopes for {q_heads} query heads")
    return q.with_shape(q.shape[:3] + (v.shape[3],))


def _check_int8_cache(k, v, k_scales, v_scales, positions) -> None:
    if k_scales is None and v_scales is None:
        if k.dtype == "i8" or v.dtype == "i8":
            raise OpError("attention: int8 k/v need their k_scales and v_scales")
        return
    if k_scales is None or v_scales is None or positions is None:
        raise OpError("attention: k_scales and v_scales come together, beside positions (an int8 KV cache)")
    for name, codes, scales in (("k", k, k_scales), ("v", v, v_scales)):
        if codes.dtype != "i8" or scales.dtype != "f32" or scales.rank != 4 or not dims_equal(scales.shape[3], 1):
            raise OpError(
                f"attention: an int8 cache's {name} must be i8 with f32 scales [..., 1], got {codes}, {scales}"
            )
        if not all(dims_equal(a, b) for a, b in zip(codes.shape[:3], scales.shape[:3])):
            raise OpError(f"attention: {name} scales {scales} do not match the codes {codes}")


def query_positions(positions, seq: int, keys: int):
    """[batch|1, 1, seq, 1]: each query's position (the causal alignment when none are given)."""
    if positions is not None:
        return positions[:, None, :, None]
    return (torch.arange(seq) + (keys - seq))[None, None, :, None]


def alibi_bias(alibi, query_pos, keys: int, dtype) -> torch.Tensor:
    """[batch|1, heads, seq, keys]: slope[h] * (key slot - query position)."""
    slopes = torch.tensor(alibi, dtype=dtype)[None, :, None, None]
    return slopes * (torch.arange(keys) - query_pos).to(dtype)


def tree_visibility(positions, tree, keys: int) -> torch.Tensor:
    """[batch, 1, seq, keys]: False where a key slot holds a token of this call that `tree` hides."""
    first = positions[:, :1, None]  # [batch, 1, 1]
    own = torch.arange(keys, device=positions.device) - first  # the index j of the call's token in each slot
    inside = (own >= 0) & (own < tree.shape[-1])
    seen = torch.gather(tree, 2, own.clamp(0, tree.shape[-1] - 1).expand(-1, tree.shape[1], -1))
    return (~inside | seen)[:, None]


def attention_reference(
    q, k, v, mask, positions, tree, k_scales=None, v_scales=None, *, scale, causal, window, softcap, alibi=()
):
    batch, q_heads, seq, head_dim = q.shape
    k, v = k[:batch], v[:batch]
    groups = q_heads // k.shape[1]
    if k_scales is not None:  # an int8 cache: the slots a query can see, dequantized (see kv_quant.py)
        used = int(positions.max()) + 1
        k = dequantize_kv(k[:, :, :used], k_scales[:batch, :, :used])
        v = dequantize_kv(v[:, :, :used], v_scales[:batch, :, :used])
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    keys = k.shape[2]
    if alibi:
        scores = scores + alibi_bias(alibi, query_positions(positions, seq, keys), keys, scores.dtype)
    visible = torch.ones(1, 1, seq, keys, dtype=torch.bool)
    if positions is not None:
        key_slot = torch.arange(keys)
        query_pos = positions[:, None, :, None]
        visible = key_slot <= query_pos
        if window:
            visible = visible & (key_slot > query_pos - window)
        if tree is not None:
            visible = visible & tree_visibility(positions, tree, keys)
    elif causal:
        visible = torch.ones(seq, keys, dtype=torch.bool).tril(keys - seq)[None, None]
        if window:
            visible = visible & ~torch.ones(seq, keys, dtype=torch.bool).tril(keys - seq - window)[None, None]
    if mask is not None:
        if mask.dtype == torch.bool:
            visible = visible & mask
        else:
            scores = scores + mask
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing attends to nothing
    return probs @ v


def _kv_write_infer(cache, new, positions, block_table=None):
    if block_table is not None:
        check_block_table(block_table, new.shape[0], "kv_write")
    if cache.rank != 4 or new.rank != 4:
        raise OpError("kv_write: cache and new must be [batch, kv_heads, seq, head_dim]")
    if not (dims_equal(cache.shape[1], new.shape[1]) and dims_equal(cache.shape[3], new.shape[3])):
        raise OpError(f"kv_write: new {new} does not fit cache {cache}")
    return cache


def kv_write_reference(cache, new, positions, block_table=None):
    batch, heads = new.shape[0], new.shape[1]
    out = cache.clone()
    if block_table is not None:  # a paged pool (paged_kv.py)
        out.index_put_(paged_write_index(new, positions, block_table, cache.shape[2]), new.to(cache.dtype))
        return out
    rows = torch.arange(batch)[:, None, None]
    head = torch.arange(heads)[None, :, None]
    out.index_put_((rows, head, positions[:, None, :]), new.to(cache.dtype))
    return out


register(
    OpDef(
        "attention",
        ("q", "k", "v", "mask?", "positions?", "tree?", "k_scales?", "v_scales?"),
        _attention_infer,
        attention_reference,
        attrs={"scale": None, "causal": False, "window": 0, "softcap": 0.0, "alibi": ()},
    )
)
register(
    OpDef(
        "kv_write",
        ("cache", "new", "positions", "block_table?"),
        _kv_write_infer,
        kv_write_reference,
        doc="cache[b, :, positions[b, t], :] = new[b, :, t, :] for the first batch rows (with block_table: "
        "pool[block_table[b, p // block_size], :, p % block_size, :], see paged_kv.py); returns the cache",
    )
)
