"""The IR's collectives (`all_reduce`, `all_gather`) as torch.distributed functional collectives.

Functional collectives (torch.distributed._functional_collectives) return new tensors instead of
writing in place, so Dynamo traces them into the graph (`_c10d_functional.all_reduce` and
`wait_tensor` ops) and Inductor compiles the whole sharded forward as one graph, with no graph
break per layer. They run over the default process group (gloo on CPU, NCCL on CUDA). A world of
one rank is the identity, like the IR's reference kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def all_reduce_sum(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The IR's `all_reduce`: the sum of x over the ranks of the default process group."""
    if world_size == 1:
        return x
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def all_gather(x: torch.Tensor, axis: int, world_size: int) -> torch.Tensor:
    """The IR's `all_gather`: the ranks' x concatenated along `axis` (non-negative) in rank order."""
    if world_size == 1:
        return x
    return funcol.all_gather_tensor(x, axis, dist.group.WORLD)


def lower_all_reduce(b, node, args, attrs):
    return b.call(all_reduce_sum, args[0], attrs["world_size"])


def lower_all_gather(b, node, args, attrs):
    axis = attrs["axis"] % node.inputs[0].type.rank
    return b.call(all_gather, args[0], axis, attrs["world_size"])


COLLECTIVE_LOWERINGS = {"all_reduce": lower_all_reduce, "all_gather": lower_all_gather}
