"""The products' part of bench/gpu_kernels.py: y = x @ W.T at decode shapes, Kiln's Triton GEMV
(backends/inductor/cuda_gemv_kernel.py) over a grid of launch parameters against cuBLAS, the
int8 form, Inductor's tuned reduction and tinygemm.

Kiln's kernel compiles once per (format, K, rows, config): N is a runtime argument, so the items
of one model, format, K and row count share each compile (Llama's qkv, o, gate+up and lm_head)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from gpu_kernels_timing import copies_for, first_run_s, per_launch_us, pow2, relative_error
from kiln.backends.inductor.cuda_gemv import CONFIGS, TILE_LIMIT
from kiln.backends.inductor.cuda_lowerings import linear_int8_channels, tinygemm_weight
from kiln.ir.ops.quantized import linear_q_reference

GROUP = 32  # int4 group size (tinygemm's smallest)
BLOCK_NS, BLOCK_KS, WARPS, STAGES = (1, 2, 4, 8, 16, 32, 64), (128, 256, 512, 1024, 2048), (1, 2, 4, 8), (1, 2, 3, 4)
DEFAULT_STAGES = 3  # Triton's default on NVIDIA, which CONFIGS run with
PER_THREAD = (4, 64)  # f32 products a thread holds: fewer leave lanes idle, more spill registers
DRY_CONFIG = (16, 64, 1, 1)


def products(spec) -> list[tuple[str, int, int]]:
    """(name, N, K) of a layer's products and the lm_head."""
    _, hidden, inter, heads, kv_heads, dim, vocab, _ = spec
    qkv = (heads + 2 * kv_heads) * dim
    return [("qkv", qkv, hidden), ("o", hidden, heads * dim), ("gate+up", 2 * inter, hidden),
            ("down", hidden, inter), ("lm_head", vocab, hidden)]  # fmt: skip


def weight_bytes(fmt: str, n: int, k: int, dtype) -> int:
    if fmt == "int4":
        return n * k // 2 + n * (k // GROUP) * 4  # codes, f32 scales (Kiln's default scale dtype)
    if fmt == "int8":
        return n * k + n * 4
    return n * k * dtype.itemsize


def product_items(models: dict, rows_list) -> list[dict]:
    return [
        dict(model=model, product=name, n=n, k=k, rows=rows, format=fmt, dtype=str(spec[0]).split(".")[1],
             bytes=weight_bytes(fmt, n, k, spec[0]) + rows * k * spec[0].itemsize, baselines={}, kiln={})
        for model, spec in models.items() for fmt in spec[7] for rows in rows_list for name, n, k in products(spec)
    ]  # fmt: skip


def groups_of(items: list[dict]) -> list[list[dict]]:
    """Items that share Kiln's compiles: same model, format, K and rows."""
    keyed: dict = {}
    for item in items:
        keyed.setdefault((item["model"], item["format"], item["k"], item["rows"]), []).append(item)
    return list(keyed.values())


# -- inputs and launches -------------------------------------------------------------------------
def product_inputs(item: dict, device: str) -> dict:
    """x and copies of a random weight in the item's format."""
    n, k, rows, dtype = item["n"], item["k"], item["rows"], getattr(torch, item["dtype"])
    copies = copies_for(weight_bytes(item["format"], n, k, dtype))
    live = {"x": torch.randn(rows, k, device=device).to(dtype), "copies": copies}
    if item["format"] == "float":
        live["weight"] = torch.empty(copies, n, k, dtype=dtype, device=device).normal_(0, 0.02)
    elif item["format"] == "int8":
        live["weight"] = torch.randint(-127, 128, (copies, n, k), dtype=torch.int8, device=device)
        live["scales"] = torch.rand(copies, n, device=device) * 1e-3
    else:
        live["qweight"] = torch.randint(0, 256, (copies, n, k // 2), dtype=torch.uint8, device=device)
        live["scales"] = torch.rand(copies, n, k // GROUP, device=device) * 1e-2
    return live


def reference_product(item: dict, live: dict) -> torch.Tensor:
    """Copy 0's product in f32, to check Kiln's launches against."""
    x = live["x"].float()
    if item["format"] == "float":
        return F.linear(x, live["weight"][0].float())
    if item["format"] == "int8":
        return linear_int8_channels(x, live["weight"][0], live["scales"][0], None)
    return linear_q_reference(x, live["qweight"][0], live["scales"][0], None, None, 4, GROUP)


def kiln_launch(item: dict, live: dict, config):
    """Kiln's kernel at config = (BLOCK_N, BLOCK_K, warps, stages), given its arguments as
    cuda_gemv's launchers give them (which take no stages)."""
    import triton

    from kiln.backends.inductor import cuda_gemv_kernel as kernels

    (block_n, block_k, warps, stages), x, n = config, live["x"], item["n"]
    rows, k = x.shape
    meta = dict(K=k, ROWS=rows, ROWS_PAD=pow2(rows), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False)
    meta |= dict(num_warps=warps, num_stages=stages)
    grid = (triton.cdiv(n, block_n),)

    def launch(i):
        y = x.new_empty(rows, n)
        if item["format"] == "int4":
            q, s = live["qweight"][i], live["scales"][i]
            kernels.gemv_int4_kernel[grid](x, q, s, s, s, y, n, k, q.stride(0), s.stride(0), n,
                                           GROUP=GROUP, HAS_ZEROS=False, **meta)  # fmt: skip
        else:
            w, scaled = live["weight"][i], item["format"] == "int8"
            kernels.gemv_kernel[grid](x, w, live["scales"][i] if scaled else w, w, y, n, k, k, n, SCALED=scaled, **meta)
        return y

    return launch


def eager_forms(item: dict, live: dict, on_gpu: bool) -> dict:
    """The uncompiled forms Kiln's kernel competes with: cuBLAS, the int8 form, tinygemm (GPU only)."""
    x = live["x"]
    if item["format"] == "float":
        return {"cuBLAS": lambda i: F.linear(x, live["weight"][i])}
    if item["format"] == "int8":
        return {"eager int8": lambda i: linear_int8_channels(x, live["weight"][i], live["scales"][i], None)}
    if not on_gpu:
        return {}
    packed = [
        tinygemm_weight(live["qweight"][i], live["scales"][i], None, GROUP, "cuda") for i in range(live["copies"])
    ]
    return {"tinygemm": lambda i: torch.ops.aten._weight_int4pack_mm(x, packed[i][0], GROUP, packed[i][1])}


def _float_product(x, weight):
    return F.linear(x, weight)


def _int8_product(x, codes, scales):
    return linear_int8_channels(x, codes, scales, None)


def compiled_form(item: dict, live: dict, mode: str | None = None):
    """The product under torch.compile as Kiln's decode compiles it: coordinate-descent tuning,
    under which one row becomes a reduction (converting int8 codes as it reads them)."""
    from torch._inductor import config as inductor_config

    x, w = live["x"], live["weight"]
    fn = torch.compile(_float_product if item["format"] == "float" else _int8_product, dynamic=False, mode=mode)
    args = (lambda i: (w[i],)) if item["format"] == "float" else (lambda i: (w[i], live["scales"][i]))
    with inductor_config.patch(coordinate_descent_tuning=True):
        fn(x, *args(0))  # compiles and tunes
    return lambda i: fn(x, *args(i))


# -- the configurations --------------------------------------------------------------------------
def config_name(config) -> str:
    return "{}x{} w{} s{}".format(*config)


def config_of(name: str) -> tuple:
    tile, warps, stages = name.split()
    return (*map(int, tile.split("x")), int(warps[1:]), int(stages[1:]))


def per_thread(item: dict, block_n: int, block_k: int, warps: int) -> float:
    """f32 products each thread holds (the int4 kernel's tile is half its block)."""
    return pow2(item["rows"]) * block_n * block_k / (2 if item["format"] == "int4" else 1) / (32 * warps)


def launcher_fits(item: dict, block_n: int, block_k: int) -> bool:
    """cuda_gemv's rule (its `_fits`): rows x BLOCK_N x BLOCK_K within TILE_LIMIT (twice for int4)."""
    return pow2(item["rows"]) * block_n * block_k <= TILE_LIMIT * (2 if item["format"] == "int4" else 1)


def today_configs(item: dict, dry: bool) -> list:
    """CONFIGS as Triton's autotuner sees them for this item."""
    if dry:
        return [DRY_CONFIG]
    return [(n, k, w, DEFAULT_STAGES) for n, k, w in CONFIGS if launcher_fits(item, n, k)]


def tile_grid(item: dict, dry: bool) -> list:
    """Every tile that fits, at the warps that give each thread about 16 products; every other
    BLOCK_N and BLOCK_K first, so that a search cut short by the budget still spans the grid."""
    if dry:
        return [DRY_CONFIG]
    grid = []
    for n in BLOCK_NS:
        for k in BLOCK_KS:
            if k <= max(pow2(item["k"]), BLOCK_KS[0]) and launcher_fits(item, n, k):
                warps = min(WARPS, key=lambda w: abs(per_thread(item, n, k, w) - 16))
                grid.append((n, k, warps, DEFAULT_STAGES))
    return sorted(grid, key=lambda c: BLOCK_NS.index(c[0]) % 2 + BLOCK_KS.index(c[1]) % 2 > 0)


def refinements(item: dict, best, dry: bool) -> list:
    """The best tile at the other warps (within PER_THREAD), and at the other stages."""
    if dry:
        return []
    n, k, warps, stages = best
    low, high = PER_THREAD
    others = [(n, k, w, stages) for w in WARPS if w != warps and low <= per_thread(item, n, k, w) <= high]
    return others + [(n, k, warps, s) for s in STAGES if s != stages]


def fitted(item: dict, config) -> tuple:
    """A one-row winner for more rows: BLOCK_N halved until the tile fits the launcher's rule."""
    n, k, warps, stages = config
    while n > 1 and not launcher_fits(item, n, k):
        n //= 2
    return (n, k, warps, stages)


def best_config(item: dict, among=None) -> str | None:
    timed = {c: us for c, us in item["kiln"].items() if among is None or c in among}
    return min(timed, key=timed.get) if timed else None


# -- the search ----------------------------------------------------------------------------------
def time_configs(group, lives, configs, stop: float, forced: int, on_gpu: bool, totals: dict) -> None:
    """Each new config compiled (the group's first launch) and timed on every item of the group,
    until `stop`; the first `forced` regardless."""
    for index, config in enumerate(configs):
        name = config_name(config)
        if name in group[0]["kiln"]:
            continue
        if index >= forced and time.perf_counter() > stop:
            group[0]["cut"] = group[0].get("cut", 0) + 1
            continue
        try:
            for item, live in zip(group, lives, strict=True):
                launch = kiln_launch(item, live, config)
                seconds, _ = first_run_s(launch)  # the group's first compiles; the others find it
                totals["gemv compile s"] += seconds
                item["kiln"][name] = per_launch_us(launch, live["copies"], on_gpu)
        except Exception as error:  # noqa: BLE001 - a config Triton cannot build (resources) is a result
            group[0].setdefault("failed", {})[name] = repr(error)[:160]
        totals["gemv configs"] += 1


def search_group(group, stop: float, on_gpu: bool, dry: bool, seeds: list, totals: dict, max_autotune=False) -> None:
    """The eager baselines, then Kiln's configs for one compile group: at one row CONFIGS, the
    tile grid (to 70% of the group's time), then warps and stages around each item's best; at
    more rows CONFIGS and `seeds` (the one-row winners)."""
    lives = [product_inputs(item, "cuda" if on_gpu else "cpu") for item in group]
    for item, live in zip(group, lives, strict=True):
        forms = eager_forms(item, live, on_gpu)
        if max_autotune and item["format"] == "float":
            forms["max-autotune"] = compiled_form(item, live, "max-autotune-no-cudagraphs")
        for name, launch in forms.items():
            first_run_s(launch)
            item["baselines"][name] = per_launch_us(launch, live["copies"], on_gpu)
    today, one_row, start = today_configs(group[0], dry), group[0]["rows"] == 1, time.perf_counter()
    grid = today + [fitted(group[0], s) for s in seeds] + (tile_grid(group[0], dry) if one_row else [])
    time_configs(group, lives, grid, start + 0.7 * (stop - start) if one_row else stop, len(today), on_gpu, totals)
    if one_row:
        bests = dict.fromkeys(config_of(best) for best in map(best_config, group) if best)
        time_configs(group, lives, [c for b in bests for c in refinements(group[0], b, dry)], stop, 0, on_gpu, totals)
    for item, live in zip(group, lives, strict=True):
        item["today"] = best_config(item, {config_name(c) for c in today})
        item["best"] = best_config(item)
        if item["best"]:  # none where every config failed
            got = kiln_launch(item, live, config_of(item["best"]))(0)
            item["kiln error"] = relative_error(got, reference_product(item, live))


def time_inductor(item: dict, on_gpu: bool, totals: dict) -> None:
    """Inductor's form of one product (a compile and a coordinate-descent tuning of its own)."""
    live = product_inputs(item, "cuda" if on_gpu else "cpu")
    start = time.perf_counter()
    compiled = compiled_form(item, live)
    totals["inductor compile s"] += time.perf_counter() - start
    item["baselines"]["Inductor"] = per_launch_us(compiled, live["copies"], on_gpu)
