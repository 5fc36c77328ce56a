"""The torch.distributed process group a tensor-parallel artifact runs in.

Kiln runs no cluster of its own: `torchrun --nproc-per-node N -m kiln generate ARTIFACT ...`
starts N processes with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and `kiln.load`
joins them into the default process group (gloo on CPU, NCCL on CUDA). Every rank runs the same
generation loop in lockstep: the logits are all-gathered, so every rank samples the same token.
"""

from __future__ import annotations

import atexit
import os

from kiln.ir.errors import KilnError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TensorParallelError(KilnError):
    """A tensor-parallel artifact was opened outside a matching torchrun job."""


def join_process_group(world_size: int, device: str = "cpu") -> int:
    """This process's rank in the default process group of `world_size` ranks, initializing the
    group from torchrun's environment unless the caller already did."""
    import torch
    import torch.distributed as dist

    command = f"torchrun --nproc-per-node {world_size} -m kiln generate ARTIFACT --prompt ..."
    if not dist.is_initialized():
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise TensorParallelError(
                f"this artifact is sharded over {world_size} ranks (tensor parallel) and needs one process per "
                f"rank; {', '.join(missing)} is not set. Fix: start it with `{command}` (or initialize "
                "torch.distributed yourself before kiln.load)"
            )
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend)
        atexit.register(_leave_process_group)
    if dist.get_world_size() != world_size:
        raise TensorParallelError(
            f"this artifact is sharded over {world_size} ranks but the job has {dist.get_world_size()}. "
            f"Fix: start it with `{command}`, or recompile with --tensor-parallel {dist.get_world_size()}"
        )
    return dist.get_rank()


def is_main_rank() -> bool:
    """Whether this process prints: rank 0 of a tensor-parallel job, or any single process."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
