"""exp2 for tinygrad's CPU (clang) kernels as one branch-free inline function per element.

tinygrad 0.14's clang renderer has no EXP2, so every exp (softmax, silu's sigmoid) is decomposed
into its `xexp2` polynomial after the kernel's upcast lanes were devectorized into scalars. In
that expanded form, with its NaN and infinity selects spread over each lane, clang neither
vectorizes the lanes (SLP) nor keeps the selects branch-free: a prefill chunk's exp passes ran
one element at a time (~3-4 ns an element on the Xeon host, ~0.25 s of a 512-token SmolLM2
prompt with silu's).

`install_vector_exp` lowers a float32 EXP2 on the clang renderer to a call of `__kiln_exp2f`, a
static inline function rendered into the kernel's source: the same algorithm and constants as
`xexp2` (round half away from zero, the same degree-6 polynomial written as one expression, the
same two-factor scaling, +inf from 128, 0 under -150, NaN kept), so it gives the same floats,
with the argument clamped first instead of its specials mapped to 0 and every special case a
select. Inlined, the lanes of an upcast axis are identical branch-free code, which clang's SLP
vectorizer turns into vector instructions. Other dtypes and devices keep tinygrad's lowering.
"""

from __future__ import annotations

import functools
import math

EXP2_FUNCTION = "__kiln_exp2f"

EXP2_SOURCE = f"""static inline __attribute__((always_inline)) float {EXP2_FUNCTION}(float d) {{
  float x = d > -151.0f ? d : -151.0f;
  x = x < 128.0f ? x : 128.0f;
  int q = (int)(x + (x < 0.0f ? -0.5f : 0.5f));
  float s = x - (float)q;
  int h = q >> 1;
  float u = ((((((((((((0.00015359208919107914f*s)+0.0013392627006396651f)*s)+0.009618384763598442f)*s)
    +0.055503472685813904f)*s)+0.24022644758224487f)*s)+0.6931471824645996f)*s)+1.0f)
    *__builtin_bit_cast(float, (int)((h+127)<<23))*__builtin_bit_cast(float, (int)(((q-h)+127)<<23));
  u = d >= 128.0f ? __builtin_inff() : u;
  u = d < -150.0f ? 0.0f : u;
  return d != d ? d : u;
}}"""

EXP_LANES = (16, 8)  # elements of an exp kernel's contiguous output axis computed together (512 / 256 bits)
EXP_THREAD_MIN = 1 << 15  # elements under which a kernel stays on one thread (a decode step's silu: 1536)

_installed = {"patterns": None, "render_kernel": None, "apply_opts": None}


def _exp2_call(ctx, d):
    """EXP2(d) as a call of EXP2_FUNCTION for the clang renderer; None (tinygrad's xexp2) elsewhere."""
    from tinygrad.renderer.cstyle import ClangRenderer
    from tinygrad.uop.ops import Ops, UOp

    if not isinstance(ctx, ClangRenderer):
        return None
    return UOp(Ops.CUSTOM, d.dtype, (d,), f"{EXP2_FUNCTION}({{0}})")


@functools.cache
def transcendental_patterns(ops, force_transcendental: bool):
    """tinygrad's get_transcendental_patterns, a float32 EXP2 on the clang renderer first."""
    from tinygrad import dtypes
    from tinygrad.uop.ops import Ops, PatternMatcher, UPat

    original = _installed["patterns"](ops, force_transcendental)
    if force_transcendental:
        return original
    ours = PatternMatcher([(UPat(Ops.EXP2, dtype=dtypes.float32, src=(UPat.var("d"),)), _exp2_call)])
    return ours + original


def render_kernel(self, function_name, kernel, bufs, uops, prefix=None) -> str:
    """ClangRenderer.render_kernel with EXP2_SOURCE ahead of a kernel that calls it."""
    source = _installed["render_kernel"](self, function_name, kernel, bufs, uops, prefix)
    return f"{EXP2_SOURCE}\n{source}" if f"{EXP2_FUNCTION}(" in source else source


def exp_kernel_opts(k):
    """k with its contiguous output axis upcast by 16 (or 8) and, from EXP_THREAD_MIN elements,
    split over the threads, for an elementwise kernel computing a float32 exp; None for any other
    kernel.

    tinygrad's heuristic upcasts such a kernel by 3 or 4 (whatever divides), so its lanes fill at
    most a 128-bit vector, and 3 do not vectorize at all."""
    from tinygrad import dtypes
    from tinygrad.codegen.opt import KernelOptError, Opt, OptOps
    from tinygrad.helpers import NUM_CPU_THREADS
    from tinygrad.uop.ops import AxisType, Ops

    nodes = k.ast.toposort()
    if k.reduceop is not None or not any(u.op is Ops.EXP2 and u.dtype == dtypes.float32 for u in nodes):
        return None
    if not all(isinstance(d, int) for d in k.full_shape):
        return None
    stores = [u for u in nodes if u.op is Ops.STORE]
    if len(stores) != 1:
        return None
    terms = list(stores[0].src[0].src[1].get_idx().split_uop(Ops.ADD))
    lanes = [i for i in k.upcastable_dims if any(t is k.rngs[i] for t in terms)]
    lane = next((i for i in lanes if any(k.full_shape[i] % n == 0 for n in EXP_LANES)), None)
    if lane is None:
        return None
    k = k.copy()
    try:
        k.apply_opt(Opt(OptOps.UPCAST, lane, next(n for n in EXP_LANES if k.full_shape[lane] % n == 0)))
        threads = NUM_CPU_THREADS.value
        if threads > 1 and math.prod(k.full_shape) >= EXP_THREAD_MIN:
            axis = next((a for a in k.axes_of(AxisType.GLOBAL, AxisType.WEAK) if k.full_shape[a] % threads == 0), None)
            if axis is not None:
                k.apply_opt(Opt(OptOps.THREAD, axis, threads))
    except KernelOptError:
        return None
    return k


def apply_opts(ast, ren, beam: int = 0):
    """tinygrad's apply_opts (as kernel_opts.py wraps it), with `exp_kernel_opts` for the clang
    renderer's exp kernels."""
    from tinygrad.codegen.opt.postrange import Scheduler
    from tinygrad.renderer.cstyle import ClangRenderer
    from tinygrad.uop.ops import Ops

    previous = _installed["apply_opts"]
    if beam >= 1 or ast.tag is not None or (ast.arg is not None and ast.arg.opts_to_apply is not None):
        return previous(ast, ren, beam)
    if not isinstance(ren, ClangRenderer) or not any(u.op is Ops.EXP2 for u in ast.toposort()):
        return previous(ast, ren, beam)
    k = Scheduler(ast, ren)
    k.convert_loop_to_global()
    chosen = exp_kernel_opts(k)
    if chosen is None:
        return previous(ast, ren, beam)
    return chosen.get_optimized_ast(
        name_override=ast.arg.name if ast.arg is not None and ast.arg.name != "test" else None
    )


def install_vector_exp() -> None:
    """Route tinygrad's transcendental lowering, clang kernel rendering and kernel optimization
    (after kernel_opts.py's) through this module (idempotent)."""
    import tinygrad.codegen as codegen
    from tinygrad.renderer.cstyle import ClangRenderer

    if _installed["patterns"] is None:
        _installed["apply_opts"] = codegen.apply_opts
        codegen.apply_opts = apply_opts
        _installed["patterns"] = codegen.get_transcendental_patterns
        codegen.get_transcendental_patterns = transcendental_patterns
        _installed["render_kernel"] = ClangRenderer.render_kernel
        ClangRenderer.render_kernel = render_kernel
