"""Shape and data-movement ops: reshape, permute, slice, concat, expand, index, arange, full."""

import torch

from ..dims import Dim, normalize
from ..dtypes import to_torch
from ..registry import REQUIRED, OpDef, OpError, register
from ..tensor_type import TensorType
from .shape_rules import broadcast_shapes, norm_axis, reshape_target

BIG = 2**62  # slice ends at or past this mean "to the end"


def _permute_infer(x, perm):
    if sorted(norm_axis(p, x.rank) for p in perm) != list(range(x.rank)):
        raise OpError(f"permute: {list(perm)} is not a permutation of {x.rank} axes")
    return x.with_shape([x.shape[p] for p in perm])


def _slice_bounds(dim: Dim, start: Dim, end: Dim):
    if isinstance(start, int) and start < 0:
        start = normalize(dim + start)
    if isinstance(end, int) and end >= BIG:
        end = dim
    elif isinstance(end, int) and end < 0:
        end = normalize(dim + end)
    elif isinstance(end, int) and isinstance(dim, int):
        end = min(end, dim)
    return start, end


def _slice_infer(x, axis, start, end, step):
    axis = norm_axis(axis, x.rank)
    start, end = _slice_bounds(x.shape[axis], start, end)
    length = normalize(end - start) if step == 1 else -(-(end - start) // step)
    if isinstance(length, int) and length < 0:
        length = 0
    return x.with_shape(x.shape[:axis] + (length,) + x.shape[axis + 1 :])


def _slice_ref(x, axis, start, end, step):
    index = [slice(None)] * x.dim()
    index[axis] = slice(start, min(end, x.shape[axis]) if end < BIG else None, step)
    return x[tuple(index)]


def _concat_infer(*xs, axis):
    axis = norm_axis(axis, xs[0].rank)
    total = normalize(sum(x.shape[axis] for x in xs))
    return xs[0].with_shape(xs[0].shape[:axis] + (total,) + xs[0].shape[axis + 1 :])


def _expand_infer(x, shape):
    lead = len(shape) - x.rank
    if lead < 0:
        raise OpError("expand: target has fewer dims than the input")
    out = [d if d != -1 else (x.shape[i - lead] if i >= lead else 1) for i, d in enumerate(shape)]
    broadcast_shapes(x.shape, tuple(out))
    return x.with_shape(out)


def _index_infer(x, *indices):
    if len(indices) > x.rank:
        raise OpError("index: more index tensors than dims")
    lead = broadcast_shapes(*(i.shape for i in indices))
    return x.with_shape(lead + x.shape[len(indices) :])


def _arange_infer(start, end, step, dtype):
    return TensorType(dtype, (normalize(-(-(end - start) // step)) if step != 1 else normalize(end - start),))


register(
    OpDef(
        "reshape",
        ("x",),
        lambda x, shape: x.with_shape(reshape_target(x.shape, shape)),
        lambda x, shape: x.reshape(shape),
        attrs={"shape": REQUIRED},
    )
)
register(OpDef("permute", ("x",), _permute_infer, lambda x, perm: x.permute(perm), attrs={"perm": REQUIRED}))
register(
    OpDef(
        "slice",
        ("x",),
        _slice_infer,
        _slice_ref,
        attrs={"axis": REQUIRED, "start": 0, "end": BIG, "step": 1},
    )
)
register(OpDef("concat", ("xs*",), _concat_infer, lambda *xs, axis: torch.cat(xs, dim=axis), attrs={"axis": REQUIRED}))
register(OpDef("expand", ("x",), _expand_infer, lambda x, shape: x.expand(shape), attrs={"shape": REQUIRED}))
register(
    OpDef(
        "index",
        ("x", "indices*"),
        _index_infer,
        lambda x, *ix: x[tuple(ix)],
        doc="advanced indexing of the leading dims by broadcast integer tensors",
    )
)
register(
    OpDef(
        "arange",
        (),
        _arange_infer,
        lambda start, end, step, dtype: torch.arange(start, end, step, dtype=to_torch(dtype)),
        attrs={"start": 0, "end": REQUIRED, "step": 1, "dtype": "i64"},
        traits={"constant"},
    )
)
register(
    OpDef(
        "full",
        (),
        lambda shape, value, dtype: TensorType(dtype, shape),
        lambda shape, value, dtype: torch.full(tuple(shape), value, dtype=to_torch(dtype)),
        attrs={"shape": (), "value": REQUIRED, "dtype": "f32"},
        traits={"constant"},
    )
)
