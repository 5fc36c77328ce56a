"""Shape arithmetic shared by the type rules: broadcasting, dim normalization, reshape."""

from __future__ import annotations

import sympy
import torch

from ..dims import Dim, dims_equal, format_dim, normalize
from ..registry import OpError


def broadcast_shapes(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out = []
    for dims in zip(*padded):
        result: Dim = 1
        for d in dims:
            if d == 1:
                continue
            if result == 1:
                result = d
            elif not dims_equal(result, d):
                raise OpError(f"shapes {[tuple(map(format_dim, s)) for s in shapes]} do not broadcast")
        out.append(result)
    return tuple(out)


def norm_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise OpError(f"axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


def numel(shape) -> Dim:
    return normalize(sympy.Mul(*[sympy.sympify(d) for d in shape])) if shape else 1


def reshape_target(in_shape, target) -> tuple[Dim, ...]:
    """Resolve a single -1 in a reshape target."""
    target = tuple(normalize(d) for d in target)
    if sum(1 for d in target if d == -1) > 1:
        raise OpError("reshape target has more than one -1")
    if -1 in target:
        known = numel([d for d in target if d != -1])
        inferred = normalize(sympy.simplify(sympy.sympify(numel(in_shape)) / sympy.sympify(known)))
        target = tuple(inferred if d == -1 else d for d in target)
    if not dims_equal(numel(in_shape), numel(target)):
        raise OpError(
            f"cannot reshape [{', '.join(map(format_dim, in_shape))}] to [{', '.join(map(format_dim, target))}]"
        )
    return target


def result_dtype(*dtypes_and_ranks) -> str:
    """torch's promotion, where a rank-0 tensor ranks below dimensioned ones (like a scalar)."""
    from ..dtypes import from_torch, to_torch

    tensors = [torch.empty((1,) * rank, dtype=to_torch(dt)) for dt, rank in dtypes_and_ranks]
    result = tensors[0]
    dtype = result.dtype
    for t in tensors[1:]:
        dtype = torch.result_type(result, t)
        result = torch.empty(result.shape if result.dim() >= t.dim() else t.shape, dtype=dtype)
    return from_torch(dtype)
