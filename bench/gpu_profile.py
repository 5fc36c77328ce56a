"""Where a decode step's time goes on a GPU (bench/gpu.py profile DIR ROW...)."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu import fill


def profile(directory: Path, name: str, out: Path | None) -> None:
    """Where a decode step's time goes: the captured graph replayed alone (device time by CUDA
    events), its kernels (count, and the largest by device time, from torch.profiler), against
    the wall time of a step through `llm.generate` (the rest is host work)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import kiln

    artifact = directory / f"{name}.kiln"
    fill(artifact)
    llm = kiln.load(artifact, device="cuda", check_hashes=False)
    llm.generate([1], max_new_tokens=16, temperature=0, ignore_eos=True)
    stats = llm.generate([1], max_new_tokens=128, temperature=0, ignore_eos=True).stats
    graph = next(iter(llm.executable._graphs.values())).graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / 100
    with torch_profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    lines = [
        f"{name}: step through generate {1000 / stats.decode_tokens_per_s:.3f} ms, graph replay alone "
        f"{replay_ms:.3f} ms, {sum(e.count for e in kernels) / 10:.0f} kernels a step",
        "| kernel | per step | us a step |",
        "| --- | ---: | ---: |",
        *(f"| {e.key[:90]} | {e.count / 10:.0f} | {e.device_time_total / 10:.1f} |" for e in kernels[:20]),
    ]
    print("\n".join(lines), flush=True)
    if out is not None:
        out.write_text("\n".join(lines) + "\n")
