"""ATen shape, indexing and tensor-creation ops, registered into the ATen table (`ATEN_TO_IR`).

Output shapes of pure shape ops are taken from what torch.export recorded, so `-1`s and
SymInt arithmetic arrive already resolved. aten_table.py imports this module, so the table is
complete whenever it is imported.
"""

from __future__ import annotations

from kiln.ir import from_torch
from kiln.ir.ops.shape_rules import numel

from .aten_registry import aten, current_meta, handles, out_shape

RESHAPE_OPS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
)


@handles(*RESHAPE_OPS)
def _reshape(cx, x, *args):
    return cx.call("reshape", cx.value(x), shape=out_shape(cx))


@handles(aten.expand.default)
def _expand(cx, x, size, *args, **kwargs):
    return cx.call("expand", cx.value(x), shape=out_shape(cx))


@handles(aten.repeat.default)
def _repeat(cx, x, repeats):
    """Tile: each dim d becomes [r, d] by a broadcast, then r*d (BLOOM repeats its ALiBi rows)."""
    v = cx.value(x)
    shape = (1,) * (len(repeats) - v.type.rank) + v.type.shape
    counts = [cx.dim(r) for r in repeats]
    spread = cx.call("reshape", v, shape=tuple(d for size in shape for d in (1, size)))
    tiled = cx.call("expand", spread, shape=tuple(d for r, size in zip(counts, shape) for d in (r, size)))
    return cx.call("reshape", tiled, shape=out_shape(cx))


@handles(aten.repeat_interleave.self_int)
def _repeat_interleave(cx, x, repeats, dim=None, output_size=None):
    """Each entry along `dim` `repeats` times in a row (a MoE token, once per chosen expert)."""
    v = cx.value(x)
    if dim is None:
        v, dim = cx.call("reshape", v, shape=(numel(v.type.shape),)), 0
    dim = dim % v.type.rank
    shape = v.type.shape
    spread = cx.call("reshape", v, shape=shape[: dim + 1] + (1,) + shape[dim + 1 :])
    tiled = cx.call("expand", spread, shape=shape[: dim + 1] + (cx.dim(repeats),) + shape[dim + 1 :])
    return cx.call("reshape", tiled, shape=out_shape(cx))


@handles(aten.permute.default)
def _permute(cx, x, dims):
    return cx.call("permute", cx.value(x), perm=tuple(dims))


@handles(aten.transpose.int)
def _transpose(cx, x, a, b):
    rank = cx.value(x).type.rank
    perm = list(range(rank))
    perm[a % rank], perm[b % rank] = perm[b % rank], perm[a % rank]
    return cx.call("permute", cx.value(x), perm=tuple(perm))


@handles(aten.t.default)
def _t(cx, x):
    return cx.call("permute", cx.value(x), perm=(1, 0))


@handles(aten.numpy_T.default)
def _numpy_t(cx, x):
    rank = cx.value(x).type.rank
    return cx.call("permute", cx.value(x), perm=tuple(reversed(range(rank))))


@handles(aten.slice.Tensor)
def _slice(cx, x, dim=0, start=None, end=None, step=1):
    return cx.call(
        "slice",
        cx.value(x),
        axis=dim,
        start=cx.dim(start) if start is not None else 0,
        end=cx.dim(end) if end is not None else 2**62,
        step=step,
    )


@handles(aten.select.int)
def _select(cx, x, dim, index):
    index = cx.dim(index)
    end = 2**62 if index == -1 else index + 1
    sliced = cx.call("slice", cx.value(x), axis=dim, start=index, end=end)
    return cx.call("reshape", sliced, shape=out_shape(cx))


@handles(aten.split_with_sizes.default, aten.split.Tensor)
def _split(cx, x, sizes, dim=0):
    v = cx.value(x)
    if not isinstance(sizes, (list, tuple)):  # split.Tensor: equal chunks of `sizes`
        total = v.type.shape[dim]
        sizes = [sizes] * (total // sizes) + ([total % sizes] if total % sizes else [])
    parts, start = [], 0
    for size in sizes:
        end = cx.dim(start) + cx.dim(size)
        parts.append(cx.call("slice", v, axis=dim, start=start, end=end))
        start = end
    return tuple(parts)


@handles(aten.chunk.default)
def _chunk(cx, x, chunks, dim=0):
    total = cx.value(x).type.shape[dim]
    if not isinstance(total, int):
        raise NotImplementedError("chunk of a symbolic dim")
    return _split(cx, x, -(-total // chunks), dim)


@handles(aten.diff.default)
def _diff(cx, x, n=1, dim=-1, prepend=None, append=None):
    if n != 1:
        raise NotImplementedError("diff with n != 1")
    v = cx.value(x)
    parts = [cx.value(p) for p in (prepend,) if p is not None] + [v] + [cx.value(a) for a in (append,) if a is not None]
    v = cx.call("concat", *parts, axis=dim) if len(parts) > 1 else v
    later = cx.call("slice", v, axis=dim, start=1, end=2**62)
    earlier = cx.call("slice", v, axis=dim, start=0, end=-1)
    return cx.call("sub", later, earlier)


@handles(aten.cat.default)
def _cat(cx, tensors, dim=0):
    return cx.call("concat", *[cx.value(t) for t in tensors], axis=dim)


@handles(aten.index.Tensor)
def _index(cx, x, indices):
    if all(i is not None for i in indices):
        return cx.call("index", cx.value(x), *[cx.value(i) for i in indices])
    tensors = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if len(tensors) != 1:
        raise NotImplementedError("index with None (slice) entries around several index tensors")
    return _index_one_axis(cx, cx.value(x), *tensors[0])


def _index_one_axis(cx, v, axis: int, index):
    """x[:, ..., index] (Falcon's multi-query fused_qkv[..., [-2], :]): a `slice` when the index
    is a constant run such as [-2] or [0, 2, 4], else `index` on the axis moved to the front."""
    idx = cx.value(index)
    run = _constant_run(cx, idx, v.type.shape[axis])
    if run is not None:
        start, end, step = run
        return cx.call("slice", v, axis=axis, start=start, end=end, step=step)
    rank, index_rank = v.type.rank, idx.type.rank
    front = cx.call("permute", v, perm=(axis, *[d for d in range(rank) if d != axis]))
    taken = cx.call("index", front, idx)  # index dims, then the other axes in order
    back = (*range(index_rank, index_rank + axis), *range(index_rank), *range(index_rank + axis, index_rank + rank - 1))
    return taken if back == tuple(range(len(back))) else cx.call("permute", taken, perm=back)


def _constant_run(cx, idx, size) -> tuple[int, int, int] | None:
    """(start, end, step) when `idx` is a constant 1-D list of positions start, start+step, ..."""
    tensor = cx.graph.weights.get(idx.name) if idx.producer is None else None
    if tensor is None or tensor.dim() != 1 or not isinstance(size, int) or tensor.dtype.is_floating_point:
        return None
    positions = [p + size if p < 0 else p for p in tensor.tolist()]
    if not positions or not all(0 <= p < size for p in positions):
        return None
    step = positions[1] - positions[0] if len(positions) > 1 else 1
    if step < 1 or positions != list(range(positions[0], positions[-1] + 1, step)):
        return None
    return positions[0], positions[-1] + 1, step


@handles(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(cx, *args, dtype=None, **kwargs):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args + (1,))[:3]
    return cx.call("arange", start=cx.dim(start), end=cx.dim(end), step=step, dtype=from_torch(current_meta(cx).dtype))


@handles(
    aten.full.default,
    aten.scalar_tensor.default,
    aten.zeros.default,
    aten.ones.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
)
def _full(cx, *args, **kwargs):
    name = cx.current.target.__name__
    value = {"zeros": 0, "ones": 1, "new_zeros": 0, "new_ones": 1, "zeros_like": 0, "ones_like": 1}.get(
        name.split(".")[0]
    )
    if value is None:
        value = args[0] if name.startswith("scalar_tensor") else args[1]
    dtype = from_torch(current_meta(cx).dtype)
    value = bool(value) if dtype == "bool" else (float(value) if dtype.startswith(("f", "bf")) else int(value))
    return cx.call("full", shape=out_shape(cx), value=value, dtype=dtype)
