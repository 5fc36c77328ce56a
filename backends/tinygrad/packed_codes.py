"""int4 and int8 codes packed into 32-bit words, 16 rows interleaved, for tinygrad's CPU kernels.

tinygrad 0.14 folds no vector loads of 8-bit buffers: a product over `linear_q`'s uint8 codes
reads them a byte at a time. Stored instead as [N/16, K/per_word, 16] uint32 (per_word codes of
one row in each word, 8 for int4 and 4 for int8; the 16 rows of a block side by side, as the f32
weights of weight_layouts.py), a decode step loads 16 words at once and unpacks each code with a
shift and a mask, 16 outputs accumulating side by side; kernel_opts.py gives these products
their loops. The scales (and zero points) are interleaved to match, [N/16, groups, 16].
- int4: the words are the packed bytes themselves (low nibble first, so code i of a word is
  column 8j + i at bits 4i).
- int8: the signed codes are stored biased by 128 (unsigned, zero point 128), so every code
  unpacks the same way.
"""

from __future__ import annotations

import numpy as np
import torch
from tinygrad import Tensor, dtypes

LANES = 16  # rows interleaved per block (weight_layouts.LANES)
SYMMETRIC_ZERO = {8: 128, 4: 8}  # of the stored codes (int8 biased by 128)


def packs(n: int, k: int, bits: int, group_size: int) -> bool:
    """Whether a [n, k] weight of this grid can be stored packed (whole words per group)."""
    per_word = 32 // bits
    return n % LANES == 0 and k % group_size == 0 and group_size % per_word == 0


def packed_codes(qweight: torch.Tensor, bits: int) -> np.ndarray:
    """linear_q's codes [N, K*bits/8] (uint8 int4 pairs, or int8) -> uint32 [N/16, K*bits/32, 16]."""
    n = qweight.shape[0]
    codes = qweight.contiguous().numpy().view(np.uint8)
    if bits == 8:
        codes = codes ^ np.uint8(0x80)  # q + 128
    words = np.ascontiguousarray(codes).view("<u4").reshape(n // LANES, LANES, -1)
    return np.ascontiguousarray(words.transpose(0, 2, 1))


def unpacked(words: Tensor, bits: int, index: int) -> Tensor:
    """Code `index` of each word, as f32."""
    shifted = words.rshift(bits * index) if index else words
    last = index == 32 // bits - 1
    return (shifted if last else shifted.bitwise_and((1 << bits) - 1)).cast(dtypes.float32)


def per_block(t: Tensor | None) -> Tensor | None:
    """Interleaved [N/16, groups, 16] scales or zeros as f32 (f16 scales, u8 zeros too)."""
    return None if t is None else t.cast(dtypes.float32)


def packed_product(x: Tensor, words: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int):
    """x @ W.T for a few rows of x [..., K] and packed W: [..., N]. Per group, the codes' dot
    product with x less zero * sum(x), times the scale; one kernel (kernel_opts.py)."""
    blocks, _, lanes = words.shape
    per_word = 32 // bits
    groups = scales.shape[1]
    words_per_group = group_size // per_word
    lead = x.shape[:-1]
    xs = x.reshape(*lead, 1, groups, words_per_group, per_word, 1)
    w = words.reshape(blocks, groups, words_per_group, lanes)
    dots = None
    for i in range(per_word):
        term = xs[..., i, :] * unpacked(w, bits, i)
        dots = term if dots is None else dots + term
    dots = dots.sum(-2)  # [..., blocks, groups, lanes]
    x_sums = x.reshape(*lead, 1, groups, group_size).sum(-1).unsqueeze(-1)
    zero = SYMMETRIC_ZERO[bits] if zeros is None else per_block(zeros)
    y = ((dots - zero * x_sums) * per_block(scales)).sum(-2)
    return y.reshape(*lead, blocks * lanes)


def dequantized(words: Tensor, scales: Tensor, zeros: Tensor | None, bits: int, group_size: int) -> Tensor:
    """The f32 weight [N, K] of packed codes, for a prefill chunk's matmul. The codes are first
    copied back to linear_q's row-major bytes (one small kernel): dequantized straight from the
    words, the matmul's loads along K stride over 16 rows' words (a 128-token product ran at 0.6x
    the byte layout's speed); from the copy it runs at about twice that speed."""
    blocks, per_row, lanes = words.shape
    n = blocks * lanes
    rows = words.permute(0, 2, 1).reshape(n, per_row).bitcast(dtypes.uint8).contiguous()  # [N, K*bits/8]
    if bits == 4:
        low, high = rows.bitwise_and(0x0F), rows.rshift(4)
        codes = low.unsqueeze(-1).cat(high.unsqueeze(-1), dim=-1).reshape(n, rows.shape[1] * 2)
    else:
        codes = rows
    k = codes.shape[1]

    def columns(t: Tensor) -> Tensor:  # [B, groups, 16] -> [N, K], each group's value over its columns
        groups = t.shape[1]
        t = per_block(t).permute(0, 2, 1).reshape(n, groups, 1)
        return t.expand(n, groups, group_size).reshape(n, k)

    zero = SYMMETRIC_ZERO[bits] if zeros is None else columns(zeros)
    return (codes.cast(dtypes.float32) - zero) * columns(scales)


def lane_rows(t: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` [T] of an interleaved [N/16, C, 16] tensor: [T, C]."""
    blocks = t[ids // LANES]  # [T, C, 16]
    lane = (ids % LANES).reshape(-1, 1, 1) == Tensor.arange(LANES, dtype=dtypes.int32).reshape(1, 1, LANES)
    return lane.where(blocks, 0).sum(-1, dtype=t.dtype)


def gathered_rows(words: Tensor, scales: Tensor, zeros: Tensor | None, ids: Tensor, bits: int, group_size: int):
    """The f32 rows `ids` [T] of a packed weight (a quantized tied embedding's gather): [T, K]."""
    per_word = 32 // bits
    row_words = lane_rows(words, ids)  # [T, K/per_word]
    codes = Tensor.stack(*[unpacked(row_words, bits, i) for i in range(per_word)], dim=-1)
    t, k = codes.shape[0], row_words.shape[1] * per_word
    codes = codes.reshape(t, k)

    def columns(v: Tensor) -> Tensor:  # [T, groups] -> [T, K]
        v = per_block(lane_rows(v, ids))
        return v.reshape(t, -1, 1).expand(t, v.shape[1], group_size).reshape(t, k)

    zero = SYMMETRIC_ZERO[bits] if zeros is None else columns(zeros)
    return (codes - zero) * columns(scales)
