"""The attention part of bench/gpu_kernels.py: a decode step's attention block (rope, both cache
writes, GQA attention over the seen slots) as Kiln's fused Triton kernel
(backends/inductor/cuda_decode_attention.py) at several chunks (the slots split over programs,
flash-decoding), slots a loop step and warps, against the unfused graph's ops under
torch.compile (`decode_attention_reference`, compiled as Kiln's decode compiles).

At batch 1 the unsplit kernel runs one program per kv head (3 for SmolLM2 on 132 SMs), which is
what the chunks are for."""

from __future__ import annotations

import torch

from gpu_kernels_timing import copies_for, first_run_s, per_launch_us, pow2, relative_error
from kiln.backends.inductor.cuda_decode_attention import (
    SCORE_TILE,
    decode_attention_reference,
    launch_decode_attention,
)

ATTENTION_MODELS = {"smollm2": (torch.float16, 9, 3, 64), "llama1b": (torch.bfloat16, 32, 8, 64)}  # heads, kv, dim
SLOTS, BATCHES, POSITIONS, CHUNKS = 2048, (1, 4), (127, 511, 2047), (None, 32, 64, 128, 256, 512)
TOY_ATTENTION = {"toy": (torch.bfloat16, 4, 2, 32)}
TOY_SLOTS, TOY_BATCHES, TOY_POSITIONS, TOY_CHUNKS = 64, (1, 2), (7, 63), (None, 16)
PER_THREAD = (8, 128)  # f32 products of a [groups, block_s, dim] step a thread holds


def default_tile(spec) -> tuple[int, int]:
    """The launcher's slots a step and Triton's default warps."""
    _, heads, kv_heads, dim = spec
    return min(64, max(8, SCORE_TILE // (pow2(heads // kv_heads) * pow2(dim)))), 4


def tiles(spec, dry: bool) -> list[tuple[int, int]]:
    """(block_s, warps) whose step fits PER_THREAD."""
    if dry:
        return [(16, 4)]
    _, heads, kv_heads, dim = spec
    low, high = PER_THREAD
    step = pow2(heads // kv_heads) * pow2(dim)
    return [(s, w) for s in (16, 32, 64, 128) for w in (1, 2, 4, 8) if low <= step * s / (32 * w) <= high]


def variant_name(chunk, block_s, warps) -> str:
    return f"c{chunk or '-'} b{block_s} w{warps}"


def attention_inputs(spec, batch: int, slots: int, device: str) -> dict:
    """New q, k, v, copies of both caches, rope tables."""
    dtype, heads, kv_heads, dim = spec
    copies = copies_for(2 * batch * kv_heads * slots * dim * dtype.itemsize)

    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    caches = [torch.empty(copies, batch, kv_heads, slots, dim, dtype=dtype, device=device).normal_() for _ in "kv"]
    angles = torch.randn(slots, dim // 2, device=device)
    return dict(q=randn(batch, heads, 1, dim), k=randn(batch, kv_heads, 1, dim), v=randn(batch, kv_heads, 1, dim),
                k_cache=caches[0], v_cache=caches[1], cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
                copies=copies, scale=dim**-0.5)  # fmt: skip


def attention_call(fn, live: dict, positions: torch.Tensor, **options):
    """fn (the launcher or the reference) on copy i of the caches."""
    q, k, v, cos, sin, scale = (live[name] for name in ("q", "k", "v", "cos", "sin", "scale"))
    return lambda i: fn(q, k, v, live["k_cache"][i], live["v_cache"][i], cos, sin, positions, scale, 0, **options)


def compiled_reference():
    return torch.compile(decode_attention_reference, dynamic=False)


def time_variant(case, live, positions, chunk, tile, on_gpu: bool, totals: dict) -> None:
    name = variant_name(chunk, *tile)
    if name in case["kiln"]:
        return
    launch = attention_call(launch_decode_attention, live, positions, chunk=chunk, block_s=tile[0], num_warps=tile[1])
    seconds, _ = first_run_s(launch)
    totals["attention compile s"] += seconds
    case["kiln"][name] = per_launch_us(launch, live["copies"], on_gpu)


def time_reference(case, live, positions, reference, on_gpu: bool, totals: dict) -> None:
    """The compiled unfused ops (its compile and coordinate-descent tuning on the first case)."""
    from torch._inductor import config as inductor_config

    launch = attention_call(reference, live, positions)
    with inductor_config.patch(coordinate_descent_tuning=True):
        seconds, _ = first_run_s(launch)
    totals["inductor compile s"] += seconds
    case["reference"] = per_launch_us(launch, live["copies"], on_gpu)


def search_case(case, live, spec, budget, on_gpu: bool, dry: bool, totals: dict) -> None:
    """The default launch, then every chunk, then (block_s, warps) at the best chunk, within the
    section's share of the budget; the best checked against the reference's output."""
    positions, default, chunks = positions_of(case, live), default_tile(spec), TOY_CHUNKS if dry else CHUNKS
    time_variant(case, live, positions, None, default, on_gpu, totals)
    for chunk in chunks:
        if budget.past("attention"):
            return budget.skip("attention", f"chunks of {case['model']} batch {case['batch']} @{case['position']}")
        time_variant(case, live, positions, chunk, default, on_gpu, totals)
    chunk = min(chunks, key=lambda c: case["kiln"].get(variant_name(c, *default), float("inf")))
    for tile in tiles(spec, dry):
        if budget.past("attention"):
            return budget.skip("attention", f"tiles of {case['model']} batch {case['batch']} @{case['position']}")
        time_variant(case, live, positions, chunk, tile, on_gpu, totals)


def check_best(case, live) -> None:
    """The best variant's output against the reference's (on copies of copy 0's caches)."""
    chunk, block_s, warps = case["best"].split()
    chunk = None if chunk == "c-" else int(chunk[1:])
    positions = positions_of(case, live)
    caches = {"k_cache": live["k_cache"][:1].clone(), "v_cache": live["v_cache"][:1].clone()}
    expected = attention_call(decode_attention_reference, {**live, **caches}, positions)(0)
    options = dict(chunk=chunk, block_s=int(block_s[1:]), num_warps=int(warps[1:]))
    got = attention_call(launch_decode_attention, {**live, **caches}, positions, **options)(0)
    case["kiln error"] = relative_error(got, expected)


def run_case(case, live, spec, reference, budget, on_gpu: bool, dry: bool, totals: dict) -> None:
    if reference is not None:
        time_reference(case, live, positions_of(case, live), reference, on_gpu, totals)
    search_case(case, live, spec, budget, on_gpu, dry, totals)
    case["default"] = variant_name(None, *default_tile(spec))
    case["best"] = min(case["kiln"], key=case["kiln"].get)
    check_best(case, live)


def run_attention(budget, on_gpu: bool, dry: bool, totals: dict, notes: list) -> list[dict]:
    """Every (model, batch, position) case; the reference compiled once per (model, batch)."""
    models, slots = (TOY_ATTENTION, TOY_SLOTS) if dry else (ATTENTION_MODELS, SLOTS)
    cases = []
    for model, spec in models.items():
        for batch in TOY_BATCHES if dry else BATCHES:
            live = attention_inputs(spec, batch, slots, "cuda" if on_gpu else "cpu")
            reference = compiled_reference() if on_gpu else None
            for position in TOY_POSITIONS if dry else POSITIONS:
                read = batch * spec[2] * position * spec[3] * spec[0].itemsize * 2  # the seen slots' k and v
                case = dict(model=model, batch=batch, position=position, slots=slots, bytes=read, kiln={})
                if budget.past("attention"):
                    budget.skip("attention", f"{model} batch {batch} @{position}")
                    continue
                try:
                    run_case(case, live, spec, reference, budget, on_gpu, dry, totals)
                    cases.append(case)
                    best = f"{case['kiln'][case['best']]:.1f} us ({case['best']})"
                    print(f"attention {model} batch {batch} @{position}: Kiln best {best}", flush=True)
                except Exception as error:  # noqa: BLE001 - the report says what failed; the other cases still run
                    notes.append(f"attention {model} batch {batch} @{position} failed: {error!r}"[:400])
    if not on_gpu:
        notes.append("attention: the compiled reference was not run (no GPU: torch.compile is skipped off it)")
    return cases


def positions_of(case: dict, live: dict) -> torch.Tensor:
    return torch.full((case["batch"], 1), case["position"], dtype=torch.int64, device=live["q"].device)
