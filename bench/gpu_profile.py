"""Where a decode step's time goes on a GPU (bench/gpu.py profile DIR ROW[@VARIANT] ...)."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from gpu_skeletons import fill


def _replay_ms(graph, steps: int = 100) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def _run_ms(executable, steps: int = 200) -> float:
    """Wall time of the executable's decode call alone: feeds to the device, the replay, logits back."""
    tokens, positions = torch.ones(1, 1, dtype=torch.int64), torch.full((1, 1), 7, dtype=torch.int64)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        executable.run(tokens, positions)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _kernel_family(name: str) -> str:
    """Kernels grouped by what made them: Inductor's Triton reductions / pointwise, cuBLAS, ..."""
    for prefix in ("triton_red", "triton_per", "triton_poi", "triton_tem"):
        if name.startswith(prefix):
            return prefix
    lowered = name.lower()
    for family in ("gemv", "gemm", "cutlass", "flash", "fmha", "efficient", "softmax", "copy", "elementwise"):
        if family in lowered:
            return family
    return name[:40]


def profile(directory: Path, name: str, out: Path | None, turn) -> None:
    """A decode step's time split: the step through `llm.generate` (wall), the executable's call
    alone (feeds, replay, logits back), the captured graph replayed alone (device time by CUDA
    events); the graph's kernels by family and the largest, from torch.profiler, and the kernel
    sequence of one replay (what Inductor made of a layer)."""
    import kiln

    artifact = directory / f"{name.split('@')[0]}.kiln"
    fill(artifact)
    llm = kiln.load(artifact, device="cuda", check_hashes=False)
    llm.generate([1], max_new_tokens=16, temperature=0, ignore_eos=True)  # compiles
    with turn():
        _measure(llm, name, out)


def _measure(llm, name: str, out: Path | None) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    stats = [llm.generate([1], max_new_tokens=128, temperature=0, ignore_eos=True).stats for _ in range(3)]
    step_ms = 1000 / statistics.median(s.decode_tokens_per_s for s in stats)
    run_ms = _run_ms(llm.executable)
    graph = next(iter(llm.executable._graphs.values())).graph
    replay_ms = _replay_ms(graph)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    per_step = sum(e.count for e in kernels) / 10
    busy_us = sum(e.device_time_total for e in kernels) / 10
    families: Counter = Counter()
    family_us: Counter = Counter()
    for e in kernels:
        families[_kernel_family(e.key)] += e.count / 10
        family_us[_kernel_family(e.key)] += e.device_time_total / 10
    events = sorted(
        (e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    sequence = [e.name for e in events[: int(per_step)]]
    lines = [
        f"{name}: step through generate {step_ms:.3f} ms, executable call {run_ms:.3f} ms, graph replay "
        f"{replay_ms:.3f} ms, kernels busy {busy_us / 1000:.3f} ms, {per_step:.0f} kernels a step",
        "| family | per step | us a step |",
        "| --- | ---: | ---: |",
        *(f"| {f} | {families[f]:.0f} | {family_us[f]:.1f} |" for f, _ in family_us.most_common()),
        "",
        "| kernel | per step | us a step |",
        "| --- | ---: | ---: |",
        *(f"| {e.key[:90]} | {e.count / 10:.0f} | {e.device_time_total / 10:.1f} |" for e in kernels[:25]),
        "",
        "kernel sequence of one step (first 60):",
        *(f"  {k[:100]}" for k in sequence[:60]),
    ]
    print("\n".join(lines[:40]), flush=True)
    if out is not None:
        out.write_text("\n".join(lines) + "\n")
