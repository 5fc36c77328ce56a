"""`kv_write` and `attention` as tinygrad Tensor operations, over KV buffers updated in place.

In the stateful graph every row b of a call writes consecutive cache slots start_b .. start_b+T-1
(its positions, or its `slots` where the graph takes token trees; the runtime feeds them so and
the executable checks it). The lowering
context then binds one symbolic `Variable` per row, `start{b}`, and:
- `kv_write` of a cache the executable owns is `cache[b, :, start_b:start_b+T].assign(new[b])`:
  tinygrad writes that slice of the realized buffer in place, and the jitted function replays
  the write at whatever position the variable is bound to;
- `attention` over such a write reads only the keys written so far, `cache[b, :, :start_b+T]`,
  under a causal mask aligned to the last key (plus the sliding window, if any), so a decode
  step costs O(position), not O(max_seq_len), and one compiled step serves every position;
  a token tree (`tree` fed) also hides the call's own slots start_b + j that tree[b, t, j] hides
  (the executable's plain steps feed it as None: the lower triangle, nothing more to hide).
Without start variables (a graph whose caches are plain inputs) both ops use the generic form:
`kv_write` as a one-hot scatter into a copy, `attention` over all keys under the position mask,
which is what the IR defines.
"""

from __future__ import annotations

from tinygrad import Tensor, dtypes


def lower_kv_write(ctx, node, args, attrs):
    """kv_write(cache, new, positions) -> the cache with new written at the tokens' positions."""
    cache, new, positions = args[:3]  # a block table (paged layout) was refused at load
    new = new.cast(cache.dtype)
    if ctx.starts is not None and ctx.owns_cache(node.inputs[0]):
        seq = new.shape[2]
        for b, start in enumerate(ctx.starts):
            cache[b : b + 1, :, start : start + seq, :].assign(new[b : b + 1])
        ctx.mark_written_in_place(node.outputs[0])
        return cache
    return _scatter(cache, new, positions)


def _scatter(cache: Tensor, new: Tensor, positions: Tensor) -> Tensor:
    """A copy of cache with cache[b, :, positions[b, t]] = new[b, :, t] for the first `batch` rows
    (of tokens sharing a slot, the last one wins, as with index_put_)."""
    batch, seq, slots = new.shape[0], new.shape[2], cache.shape[2]
    one_hot = positions.unsqueeze(-1) == Tensor.arange(slots).cast(positions.dtype)  # [batch, seq, slots]
    order = Tensor.arange(1, seq + 1).reshape(1, seq, 1)
    last = one_hot.where(order, 0).max(axis=1, keepdim=True)  # [batch, 1, slots]: 1 + the last t per slot
    chosen = (order == last) & one_hot
    written = (last > 0).reshape(batch, 1, slots, 1)
    scattered = chosen.cast(new.dtype).transpose(1, 2).unsqueeze(1) @ new  # [batch, heads, slots, head_dim]
    rows = written.where(scattered, cache[:batch])
    return rows if batch == cache.shape[0] else rows.cat(cache[batch:], dim=0)


def lower_attention(ctx, node, args, attrs):
    """attention(q, k, v, mask?, positions?, tree?) {scale, causal, window, softcap, alibi}.

    A `tree` input fed as None (the executable's plain steps) is the lower triangle: nothing to hide."""
    q, k, v, mask, positions, tree = args[:6]  # an int8 cache's scales: kv_quantize refused it first
    scale = attrs["scale"] if attrs["scale"] is not None else q.shape[-1] ** -0.5
    if ctx.starts is not None and ctx.written_in_place(node.inputs[1]) and ctx.written_in_place(node.inputs[2]):
        return _attention_to_written_keys(ctx, q, k, v, mask, tree, scale, attrs)
    return _attention_all_keys(q, k, v, mask, positions, tree, scale, attrs)


def _attention_to_written_keys(ctx, q, k, v, mask, tree, scale, attrs):
    """Row by row: queries at start_b + t see cache slots 0 .. start_b + t (within the window),
    and of the call's own slots start_b + j those where tree[b, t, j]."""
    seq, window = q.shape[2], attrs["window"]
    rows = []
    for b, start in enumerate(ctx.starts):
        length = start + seq
        keys, values = k[b : b + 1, :, :length], v[b : b + 1, :, :length]
        hidden = None
        one_query = isinstance(seq, int) and seq == 1  # at the last slot: it sees every key
        if not one_query or window or tree is not None:
            hidden = Tensor.ones(seq, length, dtype=dtypes.bool).triu(start + 1)
            if window:
                hidden = hidden | Tensor.ones(seq, length, dtype=dtypes.bool).tril(start - window)
            if tree is not None:  # the call's own keys sit in the last `seq` slots
                hidden = hidden | (~tree[b]).pad(((0, 0), (start, 0)))
        row_mask = None if mask is None else mask[b : b + 1 if mask.shape[0] > 1 else 1, ..., :length]
        if attrs["alibi"]:
            query_pos = (Tensor.arange(seq) + start).reshape(1, 1, seq, 1)
            row_mask = _with_alibi(row_mask, attrs["alibi"], Tensor.arange(length) - query_pos, q.dtype)
        if row_mask is None and tree is None and isinstance(start, int) and start == 0 and isinstance(seq, int):
            out = chunk_attention(q[b : b + 1], keys, values, scale, attrs["softcap"], window)
        elif row_mask is None and tree is None:
            out = keys_major_attention(q[b : b + 1], keys, values, hidden, scale, attrs["softcap"])
        else:
            out = grouped_attention(q[b : b + 1], keys, values, hidden, row_mask, scale, attrs["softcap"])
        if tree is not None:  # a tree may hide every key from a query: it gets zeros, not NaN
            out = (~hidden).any(axis=-1, keepdim=True).where(out, 0.0)
        rows.append(out)
    return rows[0].cat(*rows[1:], dim=0) if len(rows) > 1 else rows[0]


def _attention_all_keys(q, k, v, mask, positions, tree, scale, attrs):
    """The IR's definition: keys masked by positions (or causally) and the tree, all of the buffer's slots."""
    batch, seq = q.shape[0], q.shape[2]
    k, v = k[:batch], v[:batch]
    keys = k.shape[2]
    slot = Tensor.arange(keys)
    hidden = None
    if positions is not None:
        query_pos = positions.reshape(batch, 1, seq, 1).cast(dtypes.int32)
        hidden = slot > query_pos
        if attrs["window"]:
            hidden = hidden | (slot <= query_pos - attrs["window"])
        if tree is not None:
            hidden = hidden | _hidden_by_tree(positions, tree, keys)
    elif attrs["causal"]:
        query_pos = (Tensor.arange(seq) + (keys - seq)).reshape(1, 1, seq, 1)
        hidden = slot > query_pos
        if attrs["window"]:
            hidden = hidden | (slot <= query_pos - attrs["window"])
    if attrs["alibi"]:
        if positions is None:  # the last query sits at the last key
            query_pos = (Tensor.arange(seq) + (keys - seq)).reshape(1, 1, seq, 1)
        bool_mask = mask if mask is not None and mask.dtype == dtypes.bool else None
        float_mask = None if bool_mask is not None else mask
        if bool_mask is not None:
            hidden = ~bool_mask if hidden is None else hidden | ~bool_mask
        mask = _with_alibi(float_mask, attrs["alibi"], slot - query_pos, q.dtype)
    out = grouped_attention(q, k, v, hidden, mask, scale, attrs["softcap"])
    if hidden is None and (mask is None or mask.dtype != dtypes.bool):
        return out
    visible = ~hidden if hidden is not None else Tensor.ones(1, 1, seq, keys, dtype=dtypes.bool)
    if mask is not None and mask.dtype == dtypes.bool:
        visible = visible & mask
    return visible.any(axis=-1, keepdim=True).where(out, 0.0)  # a query that sees nothing gets zeros


def _hidden_by_tree(positions: Tensor, tree: Tensor, keys: int) -> Tensor:
    """[batch, 1, seq, keys]: True where a key slot holds a token of this call that `tree` hides
    (the token j of row b sits in slot positions[b, 0] + j; ir/ops/attention.py tree_visibility)."""
    batch, seq = tree.shape[0], tree.shape[-1]
    own = Tensor.arange(keys).reshape(1, 1, keys) - positions[:, :1].reshape(batch, 1, 1).cast(dtypes.int32)
    inside = (own >= 0) & (own < seq)
    index = own.clip(0, seq - 1).expand(batch, tree.shape[1], keys)
    seen = tree.cast(dtypes.int32).gather(2, index) > 0
    return (inside & ~seen).unsqueeze(1)


def grouped_attention(
    q: Tensor, k: Tensor, v: Tensor, hidden: Tensor | None, mask: Tensor | None, scale: float, softcap: float
) -> Tensor:
    """softmax(q k^T * scale [softcapped] + mask, hiding `hidden`) v, GQA heads kept grouped.

    q [batch, q_heads, seq, d]; k, v [batch, kv_heads, keys, d]; hidden/mask broadcast to
    [batch, q_heads, seq, keys]. Query head h reads kv head h // (q_heads / kv_heads), as the
    IR's repeat_interleave does, without materializing the repeated keys.
    """
    batch, q_heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    qg = q.reshape(batch, kv_heads, groups, seq, head_dim)
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)) * scale  # [batch, kv_heads, groups, seq, keys]
    if softcap:
        scores = (scores / softcap).tanh() * softcap
    if mask is not None and mask.dtype == dtypes.bool:
        hidden = ~mask if hidden is None else hidden | ~mask
    elif mask is not None:
        scores = scores + _grouped(mask, kv_heads, groups)
    if hidden is not None:
        scores = _grouped(hidden, kv_heads, groups).where(float("-inf"), scores)
    out = scores.softmax(-1) @ v.unsqueeze(2)
    return out.reshape(batch, q_heads, seq, v.shape[-1])


LANES = 16  # kernel_opts.LANES: keys and values are laid out as product weights
QUERY_BLOCK = 128  # queries per block of a chunk's causal attention


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float, window: int | None) -> Tensor:
    """Causal attention of a chunk at position 0 over its own keys: every shape fixed.

    q [batch, q_heads, seq, d]; k, v [batch, kv_heads, seq, d]. The queries run in blocks of
    QUERY_BLOCK, each over the keys up to its last query only (the causal mask hides the rest),
    so a 512-token chunk computes 10/16 of the full score matrix."""
    batch, q_heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = q_heads // kv_heads
    if seq % LANES or head_dim % LANES:
        hidden = Tensor.ones(seq, seq, dtype=dtypes.bool).triu(1)
        if window:
            hidden = hidden | Tensor.ones(seq, seq, dtype=dtypes.bool).tril(-window)
        return grouped_attention(q, k, v, hidden, None, scale, softcap)
    qg = q.reshape(batch, kv_heads, groups, seq, head_dim).contiguous()  # RoPE computed once, not per key block
    # keys and values 16 positions (resp. 16 of the head dimension) interleaved, as product weights
    k_lanes = k.reshape(batch, kv_heads, seq // LANES, LANES, head_dim).permute(0, 1, 2, 4, 3).contiguous()
    # a 17th block of values holds a column of ones: the same product sums each row's weights
    ones = Tensor.ones(batch, kv_heads, seq, 1, dtype=v.dtype).pad(((0, 0), (0, 0), (0, 0), (0, LANES - 1)))
    v_ext = v.cat(ones, dim=-1)
    ext_blocks = head_dim // LANES + 1
    v_lanes = v_ext.reshape(batch, kv_heads, seq, ext_blocks, LANES).permute(0, 1, 3, 2, 4).contiguous()
    outs = []
    for begin in range(0, seq, QUERY_BLOCK):
        end = min(begin + QUERY_BLOCK, seq)
        rows = end - begin
        # index comparisons, not a realized mask: the exp kernel's lanes then vectorize (vector_exp.py)
        key, query = Tensor.arange(end).reshape(1, end), (Tensor.arange(rows) + begin).reshape(rows, 1)
        hidden = key > query
        if window:
            hidden = hidden | (key <= query - window)
        x = qg[:, :, :, begin:end].reshape(batch, kv_heads, groups, rows, 1, head_dim, 1)
        keys = k_lanes[:, :, : end // LANES].reshape(batch, kv_heads, 1, 1, end // LANES, head_dim, LANES)
        scores = ((x * keys).sum(-2).reshape(batch, kv_heads, groups, rows, end) * scale).contiguous()
        if softcap:
            scores = (scores / softcap).tanh() * softcap
        scores = hidden.where(float("-inf"), scores)
        exps = (scores - scores.max(-1, keepdim=True)).exp().contiguous()
        w = exps.reshape(batch, kv_heads, groups, rows, 1, end, 1)
        values = v_lanes[:, :, :, :end].reshape(batch, kv_heads, 1, 1, ext_blocks, end, LANES)
        summed = (w * values).sum(-2).reshape(batch, kv_heads, groups, rows, ext_blocks * LANES)
        outs.append((summed[..., :head_dim] / summed[..., head_dim : head_dim + 1]).contiguous())
    out = outs[0].cat(*outs[1:], dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(batch, q_heads, seq, head_dim)


def keys_major_attention(
    q: Tensor, k: Tensor, v: Tensor, hidden: Tensor | None, scale: float, softcap: float
) -> Tensor:
    """grouped_attention over a cache's first keys (a symbolic count), laid out keys-major.

    q [batch, q_heads, seq, d]; k, v [batch, kv_heads, keys, d]; hidden [seq, keys] or None.
    Every intermediate is [batch, seq, keys, kv_heads, groups]: the symbolic key count is never
    an inner dimension, so each index is a constant-stride sum (a symbolic row length made
    tinygrad divide and take remainders per element), and the heads, the constant axes,
    are what kernel_opts.key_length_opts upcasts. The products and sums are written out as
    multiply-and-reduce (not matmul, whose reshapes merge the symbolic axis with the heads).
    """
    batch, q_heads, seq, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = q_heads // kv_heads
    qg = q.reshape(batch, kv_heads, groups, seq, head_dim).permute(0, 3, 1, 2, 4)
    qg = qg.reshape(batch, seq, 1, kv_heads, groups, head_dim).contiguous()
    k_rows = k.permute(0, 2, 1, 3).reshape(batch, 1, keys, kv_heads, 1, head_dim)
    scores = (qg * k_rows).sum(-1) * scale  # [batch, seq, keys, kv_heads, groups]
    if softcap:
        scores = (scores / softcap).tanh() * softcap
    if hidden is not None:
        scores = hidden.reshape(1, seq, keys, 1, 1).where(float("-inf"), scores)
    weights = scores.softmax(2)
    v_rows = v.permute(0, 2, 1, 3).reshape(batch, 1, keys, kv_heads, 1, head_dim)
    out = (weights.unsqueeze(-1) * v_rows).sum(2)  # [batch, seq, kv_heads, groups, d]
    return out.reshape(batch, seq, q_heads, head_dim).permute(0, 2, 1, 3)


def _with_alibi(mask: Tensor | None, slopes, distance: Tensor, dtype) -> Tensor:
    """A float mask plus ALiBi's slope[h] * (key slot - query position) (distance [b|1, 1, s, keys])."""
    bias = Tensor(list(slopes), dtype=dtype).reshape(1, len(slopes), 1, 1) * distance.cast(dtype)
    return bias if mask is None else mask + bias


def _grouped(mask: Tensor, kv_heads: int, groups: int) -> Tensor:
    """A [batch|1, heads|1, seq, keys] mask (or a [seq, keys] one) laid out as [.., kv_heads, groups, ..]."""
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    return mask.reshape(mask.shape[0], kv_heads, groups, *mask.shape[2:])
