"""Vector loads and stores of 8 and 16 lanes for tinygrad's CPU (clang) kernels.

tinygrad 0.14 folds the consecutive loads of an upcast axis into vectors of at most 4 lanes
(`codegen/late/coalesce.py`, `memory_coalescing`: lengths [4, 2] for 32-bit types), then
devectorizes the arithmetic into scalars and leaves clang's SLP vectorizer to rebuild it. From
float4 loads clang rebuilds 4-lane (xmm) multiply-adds only, a quarter of what an AVX-512 core
does per instruction and half of AVX2. With 16-lane loads over the interleaved weights
(weight_layouts.py: 16 rows side by side for each k) it emits full-width FMAs.

`install_wide_loads` replaces tinygrad's `memory_coalescing` by the same pass with lengths
[16, 8, 4, 2] for 32-bit buffers on the CPU device (other devices and dtypes keep tinygrad's),
renders vector types of more than 16 bytes with 16-byte alignment (tinygrad's buffers are only
known to be aligned for its float4, and clang's unaligned vector loads cost nothing more on
aligned data), and on an AVX-512 host has clang prefer 512-bit vectors
(`-mprefer-vector-width=512`: clang's default for these CPUs is 256). On one core of the Xeon
host a 512-token prefill product went from ~22 to ~70 GFLOP/s (with the 8-token tiles of
kernel_opts.py), a decode product from ~10 to ~10-11 GB/s (bound by memory there).
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict

from .vector_exp import install_vector_exp

WIDE_LENGTHS = [16, 8, 4, 2]
MAX_ALIGNMENT = 16  # bytes; what tinygrad's float4 loads already assume of its buffers

WIDE_VECTOR_FLAG = "-mprefer-vector-width=512"

_installed = {"coalescing": None, "prefix": None, "compile_cached": None}


@functools.cache
def has_avx512() -> bool:
    """Whether this x86 host runs AVX-512F (its /proc/cpuinfo flags; False elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def _lengths(buf, ctx) -> list[int] | None:
    """Vector lengths for one buffer's loads and stores; None: tinygrad's own choice."""
    from tinygrad.dtype import AddrSpace, dtypes

    if ctx is None or ctx.target.device != "CPU" or buf.addrspace == AddrSpace.REG:
        return None
    if buf.dtype not in (dtypes.float, dtypes.int, dtypes.uint):
        return None
    return WIDE_LENGTHS


def memory_coalescing(sink, ctx):
    """tinygrad's `memory_coalescing` (0.14), with `_lengths` for the CPU device's 32-bit buffers."""
    from tinygrad.dtype import AddrSpace, Invalid
    from tinygrad.uop.ops import Ops, UOp

    original = _installed["coalescing"]
    if ctx is None or ctx.target.device != "CPU":
        return original(sink, ctx)
    memory: defaultdict = defaultdict(dict)
    for u in sink.toposort():
        if u.op in {Ops.LOAD, Ops.STORE}:
            if len(u.src) != (2 if u.op is Ops.STORE else 1) or u.src[0].op is not Ops.INDEX:
                return original(sink, ctx)  # gated: tinygrad's pass says what it supports
            buf, idx_u = u.src[0].src
            if buf.addrspace == AddrSpace.REG:
                continue
            idx, valid = idx_u.get_idx(), idx_u.get_valid()
            if idx.op is Ops.ADD and idx.src[1].op is Ops.CONST:
                root_src, arg = idx.src[0], idx.src[1].val
            elif idx.op is Ops.ADD and idx.src[0].op is Ops.CONST:
                root_src, arg = idx.src[1], idx.src[0].val
            elif idx.op is Ops.CONST and idx.val is Invalid:
                root_src, arg = "INVALID", 0
            elif idx.op is Ops.CONST:
                root_src, arg = "CONST", idx.val
            else:
                root_src, arg = idx, 0
            memory[(u.op, buf, root_src, valid)].setdefault(arg, []).append(u)
    if not any(_lengths(buf, ctx) for _, buf, _, _ in memory):
        return original(sink, ctx)
    replacements = {}
    for (op, buf, base, valid), offsets in memory.items():
        lengths = (_lengths(buf, ctx) or ([4, 2] if ctx.supports_float4 and _coalesces(buf) else [])) + [1]
        runs = [[x for _, x in g] for _, g in itertools.groupby(enumerate(sorted(offsets)), lambda x: x[1] - x[0])]
        for run in runs:
            while run:
                offset = (base + run[0]) if isinstance(base, UOp) else UOp.const(run[0])
                length = next(n for n in lengths if n <= len(run) and offset.divides(n) is not None)
                group, run = run[:length], run[length:]
                offset = offset.valid(valid) if valid is not None else offset
                idx = UOp(Ops.SHRINK, src=(buf, offset, UOp.const(len(group)))) if len(group) > 1 else buf.index(offset)
                if op == Ops.STORE:
                    datas = [offsets[g][0].src[1] for g in group]
                    store = idx.store(UOp.stack(*datas) if len(datas) > 1 else datas[0])
                    for g in group:
                        replacements[offsets[g][0]] = store
                else:
                    loaded = idx.load()
                    for i, g in enumerate(group):
                        for u in offsets[g]:
                            replacements[u] = loaded.index(i) if len(group) > 1 else loaded
    return sink.substitute(replacements, name="memory coalescing")


def _coalesces(buf) -> bool:
    """Whether tinygrad's own pass would fold this buffer's loads (float, half, int, uint, fp8)."""
    from tinygrad.dtype import dtypes

    return buf.dtype in (dtypes.float, dtypes.half, dtypes.int, dtypes.uint, *dtypes.fp8s)


def render_vector_prefix(self, dt, count: int) -> str:
    """ClangRenderer's vector typedef, its alignment capped at MAX_ALIGNMENT bytes."""
    line = _installed["prefix"](self, dt, count)
    size = dt.itemsize * count
    if size > MAX_ALIGNMENT:
        line = line.replace(f"aligned({size})", f"aligned({MAX_ALIGNMENT})")
    return line


def compile_cached(self, src: str) -> bytes:
    """ClangCompiler.compile_cached with WIDE_VECTOR_FLAG on an AVX-512 host (and its own disk
    cache key, so objects built without the flag are not reused)."""
    if self.arch == "x86_64" and WIDE_VECTOR_FLAG not in self.args and has_avx512():
        self.args = [*self.args, WIDE_VECTOR_FLAG]
        if self.cachekey is not None:
            self.cachekey += "_wide512"
    return _installed["compile_cached"](self, src)


def install_wide_loads() -> None:
    """Route tinygrad's memory coalescing, clang vector typedefs and clang compiles through this
    module, and its exp2 through vector_exp.py (idempotent)."""
    import tinygrad.codegen as codegen
    from tinygrad.renderer.cstyle import ClangRenderer
    from tinygrad.runtime.support.compiler_cpu import ClangCompiler

    install_vector_exp()
    if _installed["coalescing"] is None:
        _installed["coalescing"] = codegen.memory_coalescing
        codegen.memory_coalescing = memory_coalescing
        _installed["prefix"] = ClangRenderer.render_vector_prefix
        ClangRenderer.render_vector_prefix = render_vector_prefix
        _installed["compile_cached"] = ClangCompiler.compile_cached
        ClangCompiler.compile_cached = compile_cached
