"""Fixed loop optimizations for the products over lane-interleaved weights (weight_layouts.py).

tinygrad 0.14 picks each kernel's optimizations (upcasts, unrolls, thread split) with a hand-coded
heuristic (codegen/opt/heuristic.py) or a timed BEAM search. For a matrix-vector product the
heuristic upcasts 3-4 output rows, each a dot product: the loads are float4 but the sums land in
one scalar accumulator per row, and the step waits on add latency (~6 GB/s per core).

A weight stored [N/16, K, 16] (16 output rows interleaved along K) is read instead as 16
outputs per K step: upcasting that lane axis by 16 makes every load a run of 16 contiguous
floats and keeps 16 independent accumulators, the shape a hand-written GEMV has. The heuristic
does not find it (it upcasts by 3 or 4), and BEAM would time every kernel at every load. So
`install_kernel_opts` wraps tinygrad's `apply_opts`: a kernel that reads such a weight gets
these optimizations, decided from its shape alone (nothing is searched or timed, so nothing
differs between compile and load); every other kernel keeps tinygrad's own choice.
- decode (one row, or a symbolic row count): lanes x16, two blocks at once, the reduction
  unrolled by 4, blocks split over the threads;
- prefill (a fixed chunk of rows): lanes x16 and 8 rows at once on an AVX-512 host (an 8 x 16
  tile in eight 512-bit registers, so each weight load serves 8 tokens), 4 elsewhere (eight
  256-bit registers; 8 rows spill AVX2's sixteen), blocks split over the threads, and the loop
  over blocks outside the loop over token tiles (a block's 16 weight rows stay in cache while
  every tile reads them, instead of the whole weight streamed once per tile).
A product over packed codes (packed_codes.py: uint32 words [N/16, K/per_word, 16]) gets
lanes x16, two blocks at once (a static row count of x: 4 rows at once instead, so each code
unpacked serves 4 tokens) and a group's words unrolled (each word unpacked into its codes in registers), the
blocks split over the threads from 16k words on (every SmolLM2 product; with the Python pool the
handoff had cost more than such a product takes, cpu_graph.py's native threads take it in about
a microsecond).
Kernels over a symbolic key length (cache_attention.py's keys-major attention) get their constant
axes upcast and split over the threads (`key_length_opts`; an axis of a few pieces per thread is
split first, so that the upcasts do not take it whole), and elementwise ones over the keys at a
symbolic start are split over the threads (`key_length_elementwise_opts`).
"""

from __future__ import annotations

import math

from tinygrad.codegen.opt import KernelOptError, Opt, OptOps

LANES = 16
THREAD_MIN_WORK = 1 << 18  # multiply-adds per row under which a thread split costs more than it gains
PACKED_THREAD_MIN_WORDS = (
    1 << 14
)  # packed-code words under which a product stays on one thread (cpu_graph.py hands pieces to native threads in ~1 us)

PACKED_ROW_TILE = 4  # rows of x per unpacked code: 8 rows x 16 lanes of group sums and totals spill

_installed = {"original": None}


def interleaved_product_axes(k) -> tuple[int, int, int, list[int]] | None:
    """(lane axis, block axis, reduce axis, row axes) of a kernel summing over a weight stored
    [blocks, K, LANES]; None for any other kernel."""
    from tinygrad.uop.ops import AxisType, Ops

    reduces = k.axes_of(AxisType.REDUCE)
    if len(reduces) != 1 or k.reduceop is None or k.reduceop.arg[0] is not Ops.ADD:
        return None
    reduce_rng = k.rngs[reduces[0]]
    for buf in k.bufs:
        strides = _index_strides(buf)
        if strides.get(reduce_rng) != LANES:
            continue
        lanes = [r for r, s in strides.items() if s == 1 and r is not reduce_rng and r.vmax + 1 == LANES]
        blocks = [r for r, s in strides.items() if r not in (reduce_rng, *lanes) and r in k.rngs]
        if len(lanes) != 1 or not blocks or not all(isinstance(r.vmax, int) for r in blocks):
            continue
        # several blocks (attention's keys or values per KV head): the largest is split over the threads
        lane, block = k.rngs.index(lanes[0]), k.rngs.index(max(blocks, key=lambda r: r.vmax))
        weight_axes = {k.rngs.index(r) for r in blocks}
        rows = [
            i
            for i in k.axes_of(AxisType.GLOBAL, AxisType.LOCAL, AxisType.WEAK)
            if i not in (lane, block) and i not in weight_axes
        ]
        return lane, block, reduces[0], rows
    return None


def _index_strides(buf) -> dict:
    """{range: stride} of the ranges added into a buffer's index (a constant multiple or alone)."""
    from tinygrad.uop.ops import Ops

    strides = {}
    for term in buf.src[1].get_idx().split_uop(Ops.ADD):
        if term.op is Ops.RANGE:
            strides[term] = 1
        elif term.op is Ops.MUL and term.src[0].op is Ops.RANGE and term.src[1].op is Ops.CONST:
            strides[term.src[0]] = term.src[1].arg
    return strides


def packed_product_axes(k) -> tuple[int, int, int | None] | None:
    """(lane axis, block axis, axis of a group's words) of a kernel reducing over packed codes
    (a uint32 buffer indexed by a 16-wide lane at stride 1); None for any other kernel."""
    from tinygrad import dtypes
    from tinygrad.uop.ops import AxisType

    reduces = [k.rngs[i] for i in k.axes_of(AxisType.REDUCE)]
    if not reduces or k.reduceop is None:
        return None
    for buf in k.bufs:
        if getattr(buf.src[0].dtype, "base", buf.src[0].dtype) != dtypes.uint32:
            continue
        strides = {r: s for r, s in _index_strides(buf).items() if r in k.rngs}
        lanes = [r for r, s in strides.items() if s == 1 and r not in reduces and r.vmax + 1 == LANES]
        blocks = [r for r in strides if r not in reduces and r not in lanes]
        words = [r for r, s in strides.items() if s == LANES and r in reduces]
        if len(lanes) == 1 and len(blocks) == 1:
            return k.rngs.index(lanes[0]), k.rngs.index(blocks[0]), k.rngs.index(words[0]) if words else None
    return None


def packed_product_opts(k):
    """k with the fixed optimizations for a product over packed codes, or None."""
    from tinygrad.helpers import NUM_CPU_THREADS

    axes = packed_product_axes(k)
    if axes is None:
        return None
    lane, block, words = axes
    block_id = k.rngs[block].arg[0]
    words_id = None if words is None else k.rngs[words].arg[0]
    row_id, row_tile = _packed_row_tile(k, (lane, block))
    work = math.prod(d for d in k.full_shape if isinstance(d, int))  # words read (one row of x)
    k = k.copy()
    try:
        k.apply_opt(Opt(OptOps.UPCAST, lane, LANES))
        if words_id is not None:
            axis = _axis_of(k, words_id)
            size = k.full_shape[axis]
            unroll = size if size <= 8 else 4 if size % 4 == 0 else 1
            if unroll > 1:
                k.apply_opt(Opt(OptOps.UNROLL, k.unrollable_dims.index(axis), unroll))
        if row_id is not None:  # each unpacked code serves a tile of rows (tokens) in registers
            k.apply_opt(Opt(OptOps.UPCAST, _axis_of(k, row_id), row_tile))
        elif k.full_shape[_axis_of(k, block_id)] % 2 == 0:  # two blocks' sums in flight: each a chain of adds
            k.apply_opt(Opt(OptOps.UPCAST, _axis_of(k, block_id), 2))
        threads, blocks = NUM_CPU_THREADS.value, k.full_shape[_axis_of(k, block_id)]
        if threads > 1 and blocks % threads == 0 and work >= PACKED_THREAD_MIN_WORDS:
            k.apply_opt(Opt(OptOps.THREAD, _axis_of(k, block_id), threads))
    except KernelOptError:
        return None
    return k


def _packed_row_tile(k, weight_axes: tuple[int, int]) -> tuple[int | None, int]:
    """(range id, tile) of a fixed row axis of x over packed codes (a few tokens or batch rows),
    upcast so that each code unpacked serves every row of the tile; (None, 1) when none."""
    from tinygrad.uop.ops import AxisType

    tile = PACKED_ROW_TILE
    for axis in k.axes_of(AxisType.GLOBAL, AxisType.LOCAL, AxisType.WEAK):
        size = k.full_shape[axis]
        if axis in weight_axes or not isinstance(size, int) or size < 2:
            continue
        if size <= tile or size % tile == 0:
            return k.rngs[axis].arg[0], min(size, tile)
    return None, 1


def _axis_of(k, range_id) -> int:
    """The axis of a loop; KernelOptError when an upcast took it whole (a StopIteration here would
    end the caller's compile loop early, without an error)."""
    axis = next((i for i, r in enumerate(k.rngs) if r.arg[0] == range_id), None)
    if axis is None:
        raise KernelOptError(f"loop {range_id} is gone")
    return axis


def interleaved_product_opts(k):
    """k with the fixed optimizations applied, or None when k is not such a product (or they do
    not apply)."""
    from tinygrad.helpers import NUM_CPU_THREADS

    axes = interleaved_product_axes(k)
    if axes is None:
        return None
    lane, block, reduce, rows = axes
    block_id, reduce_size = k.rngs[block].arg[0], k.full_shape[reduce]
    tile = prefill_row_tile()
    tiled_rows = [i for i in rows if isinstance(k.full_shape[i], int) and k.full_shape[i] % tile == 0]
    row_id = k.rngs[tiled_rows[0]].arg[0] if tiled_rows else None
    k = k.copy()
    try:
        k.apply_opt(Opt(OptOps.UPCAST, lane, LANES))
        if row_id is not None:
            k.apply_opt(Opt(OptOps.UPCAST, _axis_of(k, row_id), tile))
        else:
            if k.full_shape[_axis_of(k, block_id)] % 2 == 0:
                k.apply_opt(Opt(OptOps.UPCAST, _axis_of(k, block_id), 2))
            if isinstance(reduce_size, int) and reduce_size % 4 == 0:
                k.apply_opt(Opt(OptOps.UNROLL, 0, 4))
        threads, left = NUM_CPU_THREADS.value, k.full_shape[_axis_of(k, block_id)]
        work = math.prod(d for d in k.full_shape if isinstance(d, int))  # multiply-adds (one row when symbolic)
        if threads > 1 and left % threads == 0 and work >= THREAD_MIN_WORK:
            k.apply_opt(Opt(OptOps.THREAD, _axis_of(k, block_id), threads))
        if row_id is not None and _tiles_left(k, row_id) > 1:  # a 512-token SmolLM2 prompt 7-10% faster
            _loop_outside(k, block_id, row_id)  # (Xeon, 2 threads); one tile (8 tokens) has no loop to move
    except KernelOptError:
        return None
    return k


def _tiles_left(k, range_id) -> int:
    """The size of a loop after its upcast (1 when it was upcast whole, or is gone)."""
    axes = [i for i, r in enumerate(k.rngs) if r.arg[0] == range_id]
    return k.full_shape[axes[0]] if axes and isinstance(k.full_shape[axes[0]], int) else 1


def _loop_outside(k, outer_id, inner_id) -> None:
    """Swap two output loops so that `outer_id`'s runs outside `inner_id`'s when it ran inside
    (tinygrad's SWAP, which takes GLOBAL axes only, for the CPU's WEAK ones): a block of 16
    weight rows then stays in cache while every token tile reads it."""
    from tinygrad.uop.ops import graph_rewrite, remove_all_tags

    if _tiles_left(k, outer_id) == 1:  # upcast whole: no loop to move
        return
    outer, inner = k.rngs[_axis_of(k, outer_id)], k.rngs[_axis_of(k, inner_id)]
    if outer.arg[0] < inner.arg[0] or outer.arg[-1] != inner.arg[-1]:
        return
    swapped = {
        outer: outer.replace(arg=(*inner.arg[:-1], outer.arg[-1]), tag=1),
        inner: inner.replace(arg=(*outer.arg[:-1], inner.arg[-1]), tag=1),
    }
    k.ast = graph_rewrite(k.ast.substitute(swapped, name="blocks outside"), remove_all_tags, name="remove tags")


def key_length_opts(k):
    """k with fixed optimizations for a kernel over a symbolic key length (cache_attention.py's
    keys-major attention), or None for any other kernel.

    tinygrad's heuristic upcasts nothing there (it cannot prove the sizes it checks), so every
    output is one scalar chain of dependent adds. Here the constant output axes are upcast
    instead: the head axes of the scores (each key's 64-long dot products for every head in
    flight together), a 16-wide run of the head dimension and the query heads sharing a KV head
    for the weighted values (the key axis the reduction), their blocks split over the threads."""
    from tinygrad.helpers import NUM_CPU_THREADS
    from tinygrad.uop.ops import AxisType, Ops

    if k.reduceop is None or k.reduceop.arg[0] not in (Ops.ADD, Ops.MAX):
        return None
    if all(isinstance(d, int) for d in k.full_shape):
        return None
    outputs = [i for i in k.axes_of(AxisType.GLOBAL, AxisType.LOCAL, AxisType.WEAK) if isinstance(k.full_shape[i], int)]
    if not outputs:
        return None
    ids = [k.rngs[i].arg[0] for i in outputs]
    lane = _unit_stride_axis(k, outputs)
    lanes = lane is not None and k.full_shape[lane] % LANES == 0
    k = k.copy()
    threaded = not lanes and _thread_first(k, outputs)  # the scores (the weighted values keep their lanes)
    try:
        upcast = 1
        if lanes:
            k.apply_opt(Opt(OptOps.UPCAST, lane, LANES))
            upcast = LANES
        for range_id in ids:
            axis = _axis_of(k, range_id)
            if k.axis_types[axis] is AxisType.UPCAST:
                continue
            size = k.full_shape[axis]
            amount = next((a for a in (16, 9, 8, 6, 4, 3, 2) if size % a == 0 and upcast * a <= 48), 1)
            if amount > 1:
                k.apply_opt(Opt(OptOps.UPCAST, axis, amount))
                upcast *= amount
        if k.unrollable_dims and all(isinstance(k.full_shape[a], int) for a in k.unrollable_dims):
            axis = k.unrollable_dims[-1]
            if k.full_shape[axis] % 4 == 0:
                k.apply_opt(Opt(OptOps.UNROLL, len(k.unrollable_dims) - 1, 4))
        threads = NUM_CPU_THREADS.value
        for axis in k.axes_of(AxisType.GLOBAL, AxisType.WEAK) if not threaded else ():
            if threads > 1 and isinstance(k.full_shape[axis], int) and k.full_shape[axis] % threads == 0:
                k.apply_opt(Opt(OptOps.THREAD, axis, threads))
                break
    except KernelOptError:
        return None
    return k


def key_length_elementwise_opts(k):
    """k with its first constant output axis split over the threads, for an elementwise kernel
    over the keys at a symbolic start (the softmax's exponentials of 8 or 16 queries' scores,
    which tinygrad's heuristic leaves on one core); None for any other kernel."""
    if k.reduceop is not None or not any("start" in str(d) for d in k.full_shape if not isinstance(d, int)):
        return None
    from tinygrad.uop.ops import AxisType

    outputs = [i for i in k.axes_of(AxisType.GLOBAL, AxisType.LOCAL, AxisType.WEAK) if isinstance(k.full_shape[i], int)]
    k = k.copy()
    return k if _thread_first(k, outputs) else None


def _thread_first(k, outputs: list[int]) -> bool:
    """Split the first constant output axis that holds a few pieces per thread over the threads
    before the upcasts take every such axis whole: the scores of 8 or 16 queries at a symbolic
    start (8 queries x 3 KV heads upcast, 3 KV heads left) ran on one core."""
    from tinygrad.helpers import NUM_CPU_THREADS

    threads = NUM_CPU_THREADS.value
    for axis in outputs:
        size = k.full_shape[axis]
        if threads > 1 and size % threads == 0 and size >= 4 * threads:
            try:
                k.apply_opt(Opt(OptOps.THREAD, axis, threads))
                return True
            except KernelOptError:
                continue
    return False


def _unit_stride_axis(k, axes: list[int]) -> int | None:
    """The first of `axes` read at stride 1 by some buffer (a vector's lanes), or None."""
    for buf in k.bufs:
        strides = _index_strides(buf)
        for axis in axes:
            if strides.get(k.rngs[axis]) == 1:
                return axis
    return None


def prefill_row_tile() -> int:
    """Tokens per register tile of a prefill product: 8 with 512-bit vectors (wide_loads.py), else 4."""
    from .wide_loads import has_avx512

    return 8 if has_avx512() else 4


def _apply_opts(ast, ren, beam: int = 0):
    original = _installed["original"]
    if beam >= 1 or ast.tag is not None or (ast.arg is not None and ast.arg.opts_to_apply is not None):
        return original(ast, ren, beam)
    if ren.target.device != "CPU":  # the loops below are for CPU cores; a GPU's kernels get tinygrad's own
        return original(ast, ren, beam)
    from tinygrad.codegen.opt.postrange import Scheduler

    k = Scheduler(ast, ren)
    k.convert_loop_to_global()
    chosen = (
        interleaved_product_opts(k) or packed_product_opts(k) or key_length_opts(k) or key_length_elementwise_opts(k)
    )
    if chosen is None:
        return original(ast, ren, beam)
    return chosen.get_optimized_ast(
        name_override=ast.arg.name if ast.arg is not None and ast.arg.name != "test" else None
    )


def install_kernel_opts() -> None:
    """Route tinygrad's kernel optimization through `_apply_opts` (idempotent)."""
    import tinygrad.codegen as codegen

    if _installed["original"] is None:
        _installed["original"] = codegen.apply_opts
        codegen.apply_opts = _apply_opts
