"""Collectives across the ranks of a tensor-parallel graph (`kiln.passes.shard_tensor_parallel`).

- `all_reduce(x) {world_size}`: the elementwise sum of x over all ranks; every rank gets it.
- `all_gather(x) {axis, world_size}`: the ranks' x concatenated along `axis` in rank order.

A sharded graph is the same on every rank (what differs per rank lives in its weights), so a
collective names no ranks: it spans the default `torch.distributed` process group, whose size
must be `world_size`. A world of one needs no communication: the collective is the identity, and
no process group is needed. The reference kernels call `torch.distributed` directly, so the
interpreter evaluates a sharded graph in each process of a torchrun job.
"""

import torch

from ..dims import normalize
from ..errors import KilnError
from ..registry import REQUIRED, OpDef, OpError, register
from .shape_rules import norm_axis


class CollectiveError(KilnError, RuntimeError):
    """A collective ran without the process group it needs."""


def check_world(world_size: int) -> None:
    """Raise CollectiveError unless the default process group has `world_size` ranks."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveError(
            f"this graph is sharded over {world_size} ranks and needs a torch.distributed process group; "
            f"none is initialized. Fix: run it under `torchrun --nproc-per-node {world_size} ...` "
            "(kiln.load initializes the group from torchrun's environment)"
        )
    if dist.get_world_size() != world_size:
        raise CollectiveError(
            f"this graph is sharded over {world_size} ranks but the process group has {dist.get_world_size()}. "
            f"Fix: run it with `torchrun --nproc-per-node {world_size}`, or recompile with "
            f"--tensor-parallel {dist.get_world_size()}"
        )


def _check_world_attr(world_size) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise OpError(f"world_size must be a positive integer, got {world_size!r}")


def _all_reduce_infer(x, world_size):
    _check_world_attr(world_size)
    return x


def all_reduce_reference(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The sum of x over the ranks of the default process group."""
    if world_size == 1:
        return x.clone()
    import torch.distributed as dist

    check_world(world_size)
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def _all_gather_infer(x, axis, world_size):
    _check_world_attr(world_size)
    axis = norm_axis(axis, x.rank)
    shape = list(x.shape)
    shape[axis] = normalize(shape[axis] * world_size)
    return x.with_shape(shape)


def all_gather_reference(x: torch.Tensor, axis: int, world_size: int) -> torch.Tensor:
    """The ranks' x concatenated along `axis`, rank 0 first."""
    if world_size == 1:
        return x.clone()
    import torch.distributed as dist

    check_world(world_size)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=axis)


register(
    OpDef(
        "all_reduce",
        ("x",),
        _all_reduce_infer,
        all_reduce_reference,
        attrs={"world_size": REQUIRED},
        doc="sum of x over the world_size ranks of the default process group",
    )
)
register(
    OpDef(
        "all_gather",
        ("x",),
        _all_gather_infer,
        all_gather_reference,
        attrs={"axis": REQUIRED, "world_size": REQUIRED},
        doc="x of every rank concatenated along axis in rank order",
    )
)


def tensor_parallel_size(graph) -> int:
    """How many ranks a graph's collectives span (1: the graph is not sharded)."""
    return max([n.attrs["world_size"] for n in graph.nodes if n.op in ("all_reduce", "all_gather")], default=1)
