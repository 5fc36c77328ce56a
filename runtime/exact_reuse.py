"""How much of a cached prefix a prompt may reuse without changing a single bit of its results.

A slot's keys and values depend on the call that computed them, not only on the tokens: a call
feeding up to `exact_width` tokens of a row computes every position bit for bit as one-token calls
do (Inductor's few-queries attention and row-invariant linears), but a wider call (ATen's SDPA,
many-row matmuls) rounds differently for each width and start. A fresh prefill cuts a prompt of n
tokens into chunks [0, c), [c, 2c), ...; reusing r cached tokens feeds the rest from r instead. So
reuse is exact when
- every reused slot was computed by the call a fresh prefill of this prompt computes it with (the
  same start and width), or both calls were within exact_width (one-token bits), and
- the calls feeding [r, n) compute what the fresh prefill's calls compute there: r is a multiple
  of the chunk (the same calls), or every call on both sides is within exact_width.
Each slot is labelled with its call (`call_labels`): None for one-token bits, else (start, width).
Backends that declare no exact_width get 1: only one-token calls have one-token bits there (the
reference backend's 4-token chunk already rounds apart from one-token calls).
"""

from __future__ import annotations

Label = tuple[int, int] | None  # the (start, width) of a wider call; None: one-token bits


def call_labels(start: int, width: int, exact_width: int) -> list[Label]:
    """The labels of the slots one call over [start, start + width) of a row computes."""
    return [None if width <= exact_width else (start, width)] * width


def prefill_labels(start: int, end: int, chunk: int, exact_width: int) -> list[Label]:
    """The labels of slots [start, end) prefilled in chunks of `chunk` tokens from `start`."""
    labels: list[Label] = []
    for at in range(start, end, chunk):
        labels += call_labels(at, min(chunk, end - at), exact_width)
    return labels


def exact_reuse(cached: list[Label], shared: int, length: int, chunk: int, exact_width: int) -> int:
    """The most of `shared` cached tokens (labelled `cached`) a prompt of `length` tokens can
    reuse and still get the fresh prefill's bits (at most `shared`; 0 when none)."""
    fresh = prefill_labels(0, length, chunk, exact_width)
    same = 0
    limit = min(shared, len(cached))
    while same < limit and cached[same] == fresh[same]:
        same += 1
    if same % chunk == 0 or prefill_labels(same, length, chunk, exact_width) == fresh[same:]:
        return same
    return same - same % chunk  # a chunk boundary: the calls after it are the fresh prefill's
