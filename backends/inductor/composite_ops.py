"""Torch implementations of the IR ops that are more than one torch call.

The FX graph calls these functions as single nodes; Dynamo traces through them when the module is
compiled, so Inductor sees plain aten ops. Each follows its op's reference kernel in
`kiln.ir.ops` exactly, but is written so that sizes stay symbolic (no Python ints taken from
tensor shapes, no `tril` with a size-dependent diagonal) and so that caches are written in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ir.ops.attention import kv_write_reference, tree_visibility
from kiln.ir.ops.kv_quant import dequantize_kv, kv_quantize_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float) -> torch.Tensor:
    """x / rms(x) * (weight + offset), as `kiln.ir` defines it."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y
    return y * (weight + offset) if offset else y * weight


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): Inductor fuses the add into the norm's kernel."""
    total = x + residual
    return rms_norm(total, weight, eps, offset), total


def rope(x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> torch.Tensor:
    """The IR's `rope`: rotate-half rotary embedding of x[..., :2 * half] with table rows at positions."""
    cos, sin = rope_rows(positions, cos_table, sin_table)
    return rotate_half(x, cos, sin).to(x.dtype)


def rope_rows(positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor):
    """The cos/sin table rows at positions, [batch, 1, seq, half]: shared by every rope of a graph."""
    return F.embedding(positions, cos_table)[:, None], F.embedding(positions, sin_table)[:, None]


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x[..., :2 * half] rotated by the rows `rope_rows` gathered; the rest of x passes through."""
    half = cos.size(-1)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    if 2 * half == x.size(-1):
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., 2 * half :]), dim=-1)


def kv_write_inplace(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """cache[b, h, positions[b, t]] = new[b, h, t] for the first `batch` rows, in place; returns cache.

    Inside a compiled module whose cache is a registered buffer, Inductor turns this into one
    scatter kernel into the buffer (as gpt-fast's `k_out[:, :, input_pos] = k_val`): no copy of
    the whole cache per step.
    """
    return kv_write_at(cache, new, kv_write_index(new, positions))


def kv_write_index(new: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The (row, head, slot) index of kv_write: one per graph serves every layer's k and v."""
    rows = torch.arange(new.size(0), device=new.device)[:, None, None]
    heads = torch.arange(new.size(1), device=new.device)[None, :, None]
    return rows, heads, positions[:, None, :]


def kv_write_at(cache: torch.Tensor, new: torch.Tensor, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """kv_write with its index from `kv_write_index`, in place."""
    cache.index_put_(index, new if new.dtype == cache.dtype else new.to(cache.dtype))
    return cache


def kv_write_functional(
    cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor | None = None
) -> torch.Tensor:
    """kv_write on a cache the module does not own: a written copy, the caller's tensor untouched."""
    if block_table is not None:
        return kv_write_reference(cache, new, positions, block_table)
    return kv_write_inplace(cache.clone(), new, positions)


def kv_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The IR's `kv_quantize` (int8 codes and per-row scales): plain torch ops Inductor fuses."""
    return kv_quantize_reference(x)


def visible_keys(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, causal: bool, window: int
) -> torch.Tensor | None:
    """Bool [batch|1, 1, seq, keys]: which key slots each query sees (None: all of them)."""
    seq, keys = q.size(2), k.size(2)
    key_slot = torch.arange(keys, device=q.device)
    if positions is not None:
        query_pos = positions[:, None, :, None]
    elif causal:  # the last query sits at the last key
        query_pos = (torch.arange(seq, device=q.device) + (keys - seq))[None, None, :, None]
    else:
        return None
    visible = key_slot <= query_pos
    if window:
        visible = visible & (key_slot > query_pos - window)
    return visible


def alibi_bias(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, alibi: tuple[float, ...]
) -> torch.Tensor:
    """Float [batch|1, heads, seq, keys]: slope[h] * (key slot - query position), ALiBi's bias."""
    seq, keys = q.size(2), k.size(2)
    if positions is not None:
        query_pos = positions[:, None, :, None]
    else:  # the last query sits at the last key
        query_pos = (torch.arange(seq, device=q.device) + (keys - seq))[None, None, :, None]
    distance = (torch.arange(keys, device=q.device) - query_pos).to(q.dtype)
    return torch.tensor(alibi, dtype=q.dtype, device=q.device)[None, :, None, None] * distance


def scale_and_positions(b, node, args, attrs) -> tuple[float, object]:
    """What a lowering of the stateful `attention` passes its kernel: the score scale (1/sqrt(head
    dim) unless the op gives one) and the positions as int64."""
    q, positions = node.inputs[0], node.inputs[4]
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.type.shape[3])
    return float(scale), args[4] if positions.type.dtype == "i64" else b.method("long", args[4])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    tree: torch.Tensor | None,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    scale: float | None,
    causal: bool,
    window: int,
    softcap: float,
    alibi: tuple[float, ...] = (),
) -> torch.Tensor:
    """The IR's `attention`: GQA kept grouped, keys masked by positions (or causally), optional
    softcap and ALiBi bias.

    Reads only the first `batch` rows of k/v (a static cache has max_batch rows). Without softcap
    this is one `scaled_dot_product_attention` with a boolean mask (or a float mask where the
    graph supplies one or ALiBi adds its bias); softcap needs the scores themselves, so it is
    spelled out. An int8 cache (k_scales, v_scales given) is dequantized whole here: Kiln's
    attention kernel (fast_attention.py) reads it row by row instead.
    """
    batch = q.size(0)
    k, v = k[:batch], v[:batch]
    if k_scales is not None:
        k, v = dequantize_kv(k, k_scales[:batch]), dequantize_kv(v, v_scales[:batch])
    visible = visible_keys(q, k, positions, causal, window)
    if tree is not None:  # positions are given with it (the IR checks)
        visible = visible & tree_visibility(positions, tree, k.size(2))
    if mask is not None and mask.dtype == torch.bool:
        visible = mask if visible is None else visible & mask
        mask = None
    if alibi:
        bias = alibi_bias(q, k, positions, alibi)
        mask = bias if mask is None else mask + bias
    if softcap:
        return _softcapped_attention(q, k, v, visible, mask, scale, softcap)
    attn_mask = visible
    if mask is not None:  # a float mask is added to the scores; hidden keys get -inf on top
        attn_mask = mask if visible is None else mask.masked_fill(~visible, float("-inf"))
    grouped = q.size(1) != k.size(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=grouped)


def _softcapped_attention(q, k, v, visible, mask, scale, softcap):
    groups = q.size(1) // k.size(1)
    if groups != 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scale if scale is not None else q.size(-1) ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores + mask
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing attends to nothing
    return probs @ v
