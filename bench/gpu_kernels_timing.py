"""How bench/gpu_kernels.py times a kernel: a CUDA graph of launches, each on its own copy of the
inputs, and the run's wall-clock budget split between its sections.

The copies together are 3x an H100/H200's 50 MB L2: in a decode step every weight (and each
layer's cache) comes from memory, as the other layers evicted it, while relaunching one 8 MB
weight would read it from L2 and overstate the kernel's bandwidth."""

from __future__ import annotations

import statistics
import time

import torch

POOL_BYTES = 160 << 20  # a graph's input copies together
MIN_LAUNCHES, MAX_COPIES, REPLAYS = 20, 512, 7
SECTIONS = {"one row": 0.45, "inductor": 0.63, "attention": 0.83, "more rows": 0.97}  # ends, of --budget


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def copies_for(nbytes: int) -> int:
    """Copies of an input of `nbytes` that a graph cycles through."""
    return min(MAX_COPIES, max(2, -(-POOL_BYTES // nbytes)))


def per_launch_us(launch, copies: int, on_gpu: bool) -> float:
    """Median time of one launch, launch(i) running on copy i of its inputs; `launch` has run
    once already (compiled). Off the GPU (the interpreter): one call's wall time, which checks
    the code path and means nothing else."""
    if not on_gpu:
        start = time.perf_counter()
        launch(0)
        return 1e6 * (time.perf_counter() - start)
    launches = max(MIN_LAUNCHES, copies)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1000 * statistics.median(times) / launches


def first_run_s(launch):
    """Seconds of a first launch on copy 0 (Triton's or Inductor's compile included), and its output."""
    start = time.perf_counter()
    out = launch(0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference over the largest magnitude of the expected f32 values."""
    return float((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-9))


class Budget:
    """The run's wall-clock allowance: each section stops starting work once its share is spent,
    and what it skipped is listed in the report."""

    def __init__(self, seconds: float):
        self.start, self.seconds, self.skipped = time.perf_counter(), seconds, []

    def end_of(self, section: str) -> float:
        return self.start + SECTIONS[section] * self.seconds

    def past(self, section: str) -> bool:
        return time.perf_counter() > self.end_of(section)

    def skip(self, section: str, what: str) -> None:
        self.skipped.append(f"{section}: {what} (its share of --budget was spent)")
