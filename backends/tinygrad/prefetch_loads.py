"""Software prefetch ahead of the vector loads that stream a large buffer, in tinygrad's CPU
(clang) kernels.

A product over interleaved weights (weight_layouts.py) reads each thread's share of the weight as
one sequential stream, 64 bytes a load. Over 8 tokens it does 8 FMAs a load, fast enough that
the hardware prefetcher, which runs only a little ahead of the reads, leaves it waiting on
memory: on one AMD EPYC (Zen 4) the 8-token gate/up product over 30 layers' weights took 8.8-9.4
ms streamed from memory and 3.8 ms with the weights in cache. With a prefetch into L2 8 KiB ahead
of each load it took 4.9 ms (tinygrad's own kernel source, clang 19, two threads; 1 KiB ahead:
7.5 ms; 16 KiB ahead with prefetcht2: 4.9 ms; docs/backend-tinygrad.md).

A step over at most PREFETCH_MAX_TOKENS tokens a row (decode, the short chunks of 8 and 16 that
verify drafts) streams its weights; a prefill chunk reads each block of a weight again for every
tile of tokens from cache, and prefetching there made pp512 4-8% slower, so its kernels keep
plain loads (`prefetching`, set around each step's call by jitted_step.py).

`install_prefetch_loads` renders such loads (16 lanes or more of float32, from a buffer of at
least PREFETCH_MIN_BYTES: a weight or a KV cache, not a row of activations) as a statement
expression that first asks for the line PREFETCH_AHEAD bytes on. Kernels over packed int4/int8
codes (packed_codes.py, a uint32 buffer) prefetch their codes and scales too, from
CODES_MIN_BYTES (a layer's packed weight is small): on the Intel Xeon, alternating processes,
int4-g32 decode ran at 201-250 tokens/s against 145-188, and a step over 8 tokens in 18.4 ms
against 24.2. A prefill chunk's kernels (more than PREFETCH_MAX_TOKENS tokens) keep plain loads
there as well: prefetching theirs (a prompt's 16-wide activation reads among them) made int4
pp512 1.6x slower.
A prefetch never faults, so one past the buffer's end is harmless. Only the CLANG renderer's
loads change; the LLVM renderer and GPU renderers keep tinygrad's. `KILN_TINYGRAD_PREFETCH=off`
(set before the first load in a process) leaves them as tinygrad renders them, to compare.
"""

from __future__ import annotations

import contextlib
import os

PREFETCH_AHEAD = 8192  # bytes ahead of the load
PREFETCH_MIN_BYTES = 1 << 20  # buffers smaller than this (activations, scales) are not prefetched
CODES_MIN_BYTES = 1 << 16  # in kernels over packed codes: a SmolLM2 layer's codes are 0.1-0.4 MiB
PREFETCH_MIN_LANES = 16  # a full 64-byte line of 32-bit values per load
PREFETCH_MAX_TOKENS = 16  # tokens per row of a step whose kernels prefetch
_LOCALITY = 2  # __builtin_prefetch's locality 2: into L2 (prefetcht1)

_installed = {"string_rewrite": None, "render": None}
_steps = {"prefetch": True}  # whether the step being compiled now prefetches


def streams_weights(tokens: int) -> bool:
    """Whether a step over `tokens` tokens a row streams its weights (its kernels prefetch)."""
    return tokens <= PREFETCH_MAX_TOKENS


@contextlib.contextmanager
def prefetching(on: bool):
    """Kernels rendered inside prefetch (on) or keep plain loads (off)."""
    before, _steps["prefetch"] = _steps["prefetch"], on
    try:
        yield
    finally:
        _steps["prefetch"] = before


def streams(bidx, codes: bool = False) -> bool:
    """Whether a load through this index reads a whole line of a buffer large enough to stream: a
    float32 one (and, in a kernel over packed `codes`, a uint32 one) of PREFETCH_MIN_BYTES (there,
    CODES_MIN_BYTES) or more."""
    from tinygrad.dtype import dtypes
    from tinygrad.uop.ops import AddrSpace

    buffer = bidx.src[0]
    return (
        bidx.addrspace == AddrSpace.GLOBAL
        and bidx.max_numel() >= PREFETCH_MIN_LANES
        and (buffer.dtype == dtypes.float32 or (codes and buffer.dtype == dtypes.uint32))
        and buffer.max_numel() * 4 >= (CODES_MIN_BYTES if codes else PREFETCH_MIN_BYTES)
    )


def reads_packed_codes(uops) -> bool:
    """Whether a kernel reads a uint32 buffer (packed int4/int8 codes, packed_codes.py)."""
    from tinygrad.dtype import dtypes
    from tinygrad.uop.ops import Ops

    return any(u.op is Ops.PARAM and u.dtype == dtypes.uint32 for u in uops)


def render_prefetched_load(ctx, bidx):
    """The load's C expression, prefetching PREFETCH_AHEAD bytes on first; None: tinygrad's rule."""
    if not ctx.kiln_prefetch or not streams(bidx, ctx.kiln_codes):
        return None
    prefetch = f"__builtin_prefetch((const char*)({ctx[bidx]})+{PREFETCH_AHEAD},0,{_LOCALITY})"
    return f"({{{prefetch};{ctx.render_access(bidx)};}})"


def install_prefetch_loads() -> None:
    """Route the CLANG renderer's plain loads through render_prefetched_load (idempotent)."""
    from tinygrad.renderer.cstyle import ClangRenderer
    from tinygrad.uop.ops import Ops, PatternMatcher, UPat

    if _installed["string_rewrite"] is not None or os.environ.get("KILN_TINYGRAD_PREFETCH") == "off":
        return
    _installed["string_rewrite"], _installed["render"] = ClangRenderer.string_rewrite, ClangRenderer._render
    rule = (UPat(Ops.LOAD, src=(UPat.var("bidx"),)), render_prefetched_load)
    ClangRenderer.string_rewrite = PatternMatcher([rule]) + ClangRenderer.string_rewrite
    ClangRenderer.kiln_prefetch, ClangRenderer.kiln_codes = True, False
    ClangRenderer._render = render_kernel


def render_kernel(self, uops):
    """ClangRenderer._render, prefetching in a streaming step's kernels (those over packed codes
    down to CODES_MIN_BYTES, their uint32 codes too)."""
    self.kiln_prefetch, self.kiln_codes = _steps["prefetch"], reads_packed_codes(uops)
    return _installed["render"](self, uops)
