"""Linear (GEMV / small-M / prefill) kernels on CPU for SmolLM2-135M shapes.

    python bench/gemv.py                      # all shapes, M = 1, 4, 64, all methods
    python bench/gemv.py --quick              # no Inductor / onnxruntime compiles
    python bench/gemv.py --m 1 --shapes q,lm_head --methods F.linear,kiln
    python bench/gemv.py --model-only         # only the whole-model decode sweep

Two measurements:

1. Per shape x M x method: "cold" = the weights are not in cache (a 256 MB read evicts the
   caches before each timed call, as in decode where 538 MB of weights stream per token),
   "hot" = the same call repeated (weight in L2/L3: per-call overhead). GB/s = weight bytes
   streamed / cold time.
2. Whole-model decode sweep (M = 1): one token's linears of SmolLM2-135M in order, 30 layers x
   (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) + lm_head 49152x576, each with its
   own weights (538 MB fp32, far larger than the caches), timed per token.

Contention: the machine may be shared. Each measurement records the CPU time that *other*
processes used while it ran (from /proc/stat minus this process), rounds are interleaved across
methods, and the median over rounds with < 8% foreign CPU is reported ("other%" = mean foreign
load; "*" marks a result with no clean round).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # name: (N, K) of nn.Linear weight [N, K]
    "q/o": (576, 576),
    "k/v": (192, 576),
    "qkv": (960, 576),
    "gate/up": (1536, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
MAX_OTHER = 0.08
HZ = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ contention-aware timing
def _sys_busy() -> int:
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:9]))
    return sum(v) - v[3] - v[4]


def _own() -> float:
    t = os.times()
    return t.user + t.system


class Meter:
    def __enter__(self):
        self.t, self.b, self.o = time.perf_counter(), _sys_busy(), _own()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t
        foreign = max(0.0, (_sys_busy() - self.b) / HZ - (_own() - self.o))
        self.other = foreign / (dt * os.cpu_count())


_FLUSH: torch.Tensor | None = None


def flush_caches():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.ones(64 * 1024 * 1024)  # 256 MB
    _FLUSH.sum()


def cold_sample(fn, n):
    ts = []
    for _ in range(n):
        flush_caches()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def hot_sample(fn, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(methods: dict, rounds: int, cold_n: int, hot_n: int, max_rounds: int = 0):
    """methods: name -> fn. Interleaved rounds (more, up to max_rounds, while a method has no
    round with < MAX_OTHER foreign load); returns name -> (cold_s, hot_s, other, clean)."""
    for fn in methods.values():
        for _ in range(3):
            fn()
    rec = {k: [] for k in methods}
    r = 0
    while r < rounds or (r < max_rounds and any(all(o >= MAX_OTHER for *_, o in v) for v in rec.values())):
        r += 1
        for k, fn in methods.items():
            if r > rounds and any(o < MAX_OTHER for *_, o in rec[k]):
                continue
            with Meter() as m:
                c = cold_sample(fn, cold_n)
                h = hot_sample(fn, hot_n)
            rec[k].append((c, h, m.other))
    out = {}
    for k, v in rec.items():
        clean = [r for r in v if r[2] < MAX_OTHER]
        use = clean or v
        out[k] = (statistics.median(r[0] for r in use), statistics.median(r[1] for r in use),
                  statistics.mean(r[2] for r in v), bool(clean))
    return out


# ------------------------------------------------------------------ methods
def _compiled_linear(w, M, K, mode):
    import torch._inductor.config as icfg

    lin = torch.nn.Linear(K, w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    lin.eval().requires_grad_(False)
    torch._dynamo.reset()
    patches = {"freezing": mode != "default"}
    if mode == "freeze+cpp_wrapper":
        patches["cpp_wrapper"] = True
    if mode == "max_autotune_cpp":
        patches.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    x = torch.randn(M, K)
    with icfg.patch(patches), torch.no_grad():
        cm = torch.compile(lin, dynamic=False, fullgraph=True)
        cm(x)
    return cm


def _ort_matmul(w, M, K):
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    wt = numpy_helper.from_array(w.t().contiguous().numpy(), "Wt")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "Wt"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, w.shape[0]])], [wt])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 9)  # onnx may be newer than onnxruntime's max
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    xn = np.random.randn(M, K).astype(np.float32)
    return lambda: sess.run(None, {"x": xn})


def build_methods(N, K, M, selected, want_compiled):
    from kiln.backends.inductor import gemv_kernel as gk

    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g) * 0.02
    x = torch.randn(M, K, generator=g)
    wt = gk.pack_linear_weight(w)
    wq, sc = gk.pack_linear_weight_int8(w)
    wq_nk = wq.t().contiguous()
    f32, i8 = N * K * 4, N * K + 4 * N
    m: dict[str, tuple] = {}  # name -> (fn, bytes)

    def add(name, mk, nbytes):
        if selected and name not in selected:
            return
        try:
            fn = mk()
            fn()
        except Exception as e:  # report, keep going
            print(f"  [{name}] unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            return
        m[name] = (fn, nbytes)

    add("F.linear", lambda: (lambda: F.linear(x, w)), f32)
    if M == 1:
        add("torch.mv", lambda: (lambda: torch.mv(w, x[0])), f32)
    add("mm(x,Wt)", lambda: (lambda: torch.mm(x, wt)), f32)

    def mk_mkldnn():
        wp = torch.ops.mkldnn._reorder_linear_weight(w, M)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
    add("mkldnn_packed", mk_mkldnn, f32)
    if want_compiled:
        for mode in ("default", "freeze", "freeze+cpp_wrapper", "max_autotune_cpp"):
            def mk(mode=mode):
                cm = _compiled_linear(w, M, K, mode)
                return lambda: cm(x)
            add(f"inductor:{mode}", mk, f32)
        add("ort_mlas", lambda: _ort_matmul(w, M, K), f32)
    add("kiln", lambda: (lambda: torch.ops.kiln.linear_f32(x, wt, None)), f32)
    if want_compiled:
        def mk_kc():
            f = torch.compile(lambda a: torch.ops.kiln.linear_f32(a, wt, None), fullgraph=True, dynamic=False)
            f(x)
            return lambda: f(x)
        add("kiln:compiled", mk_kc, f32)
    add("int8pack_mm", lambda: (lambda: torch._weight_int8pack_mm(x, wq_nk, sc)), i8)
    add("kiln_i8", lambda: (lambda: torch.ops.kiln.linear_i8(x, wq, sc, None)), i8)
    return m


# ------------------------------------------------------------------ whole-model decode sweep
def model_sweep(selected, rounds, tokens):
    from kiln.backends.inductor import gemv_kernel as gk

    layer = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    seq = layer * 30 + [(49152, 576)]
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, k, generator=g) * 0.02 for n, k in seq]
    total_f32 = sum(n * k * 4 for n, k in seq)
    xs = {k: torch.randn(1, k, generator=g) for k in (576, 1536)}
    variants: dict[str, tuple] = {}

    def want(n):
        return not selected or n in selected

    if want("F.linear"):
        variants["F.linear"] = ([(xs[k], w) for (n, k), w in zip(seq, ws)], lambda a, w: F.linear(a, w), total_f32)
    if want("mkldnn_packed"):
        variants["mkldnn_packed"] = ([(xs[k], torch.ops.mkldnn._reorder_linear_weight(w, 1)) for (n, k), w in zip(seq, ws)],
                                     lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), total_f32)
    if want("mm(x,Wt)") or want("kiln"):
        packed = [(xs[k], gk.pack_linear_weight(w)) for (n, k), w in zip(seq, ws)]
        if want("mm(x,Wt)"):
            variants["mm(x,Wt)"] = (packed, lambda a, w: torch.mm(a, w), total_f32)
        if want("kiln"):
            variants["kiln"] = (packed, lambda a, w: torch.ops.kiln.linear_f32(a, w, None), total_f32)
    if want("int8pack_mm") or want("kiln_i8"):
        q = [gk.pack_linear_weight_int8(w) for w in ws]
        total_i8 = sum(n * k + 4 * n for n, k in seq)
        if want("int8pack_mm"):
            variants["int8pack_mm"] = ([(xs[k], (wq.t().contiguous(), s)) for (n, k), (wq, s) in zip(seq, q)],
                                       lambda a, p: torch._weight_int8pack_mm(a, p[0], p[1]), total_i8)
        if want("kiln_i8"):
            variants["kiln_i8"] = ([(xs[k], p) for (n, k), p in zip(seq, q)],
                                   lambda a, p: torch.ops.kiln.linear_i8(a, p[0], p[1], None), total_i8)
    del ws

    def token(items, fn):
        for a, w in items:
            fn(a, w)

    fns = {name: (lambda items=items, fn=fn: token(items, fn)) for name, (items, fn, _) in variants.items()}
    rec = {k: [] for k in fns}
    for f in fns.values():
        f()
    r = 0
    while r < rounds or (r < 3 * rounds and any(all(o >= MAX_OTHER for _, o in v) for v in rec.values())):
        r += 1
        for k, f in fns.items():
            if r > rounds and any(o < MAX_OTHER for _, o in rec[k]):
                continue
            with Meter() as m:
                t = hot_sample(f, tokens)  # weights >> cache: every token streams them from DRAM
            rec[k].append((t, m.other))
    print(f"\n## whole-model decode sweep (M=1, {len(seq)} linears/token, fp32 weights {total_f32 / 1e6:.0f} MB)")
    print(f"| method | ms/token | GB/s | tok/s (linears only) | vs F.linear | other% |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for k, v in rec.items():
        clean = [t for t, o in v if o < MAX_OTHER]
        t = statistics.median(clean or [t for t, o in v])
        base = base or (t if k == "F.linear" else None)
        nbytes = variants[k][2]
        ratio = f"{base / t:.2f}x" if base else "-"
        mark = "" if clean else "*"
        print(f"| {k} | {t * 1e3:.2f}{mark} | {nbytes / t / 1e9:.1f} | {1 / t:.1f} | {ratio} | "
              f"{100 * statistics.mean(o for _, o in v):.0f} |", flush=True)


def machine_line():
    model = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{model}; {os.cpu_count()} CPUs; torch {torch.__version__} "
            f"(capability {torch.backends.cpu.get_cpu_capability()}); threads {torch.get_num_threads()}; "
            f"loadavg {open('/proc/loadavg').read().split()[0]}; {platform.python_version()}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--m", default="1,4,64", help="comma-separated M values (rows of x)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--methods", default="", help="comma-separated subset of method names")
    ap.add_argument("--quick", action="store_true", help="skip Inductor and onnxruntime (compiles)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-rounds", type=int, default=8, help="extra rounds while contended")
    ap.add_argument("--cold", type=int, default=7, help="cold samples per round")
    ap.add_argument("--hot", type=int, default=30, help="hot samples per round")
    ap.add_argument("--model-only", action="store_true")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--tokens", type=int, default=5, help="tokens per round in the model sweep")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from kiln.backends.inductor import gemv_kernel as gk

    t = time.perf_counter()
    path = gk.ensure_loaded()
    print(f"# gemv bench: {machine_line()}")
    print(f"# kiln kernel: {path} (ensure_loaded {time.perf_counter() - t:.1f}s)")
    selected = set(filter(None, args.methods.split(",")))

    if not args.model_only:
        print("\n| shape | N x K | M | method | cold us | GB/s | GFLOP/s | hot us | vs F.linear | other% |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for name in args.shapes.split(","):
            N, K = SHAPES[name]
            for M in map(int, args.m.split(",")):
                methods = build_methods(N, K, M, selected, not args.quick)
                res = measure({k: v[0] for k, v in methods.items()}, args.rounds, args.cold, args.hot,
                              args.max_rounds)
                base = res.get("F.linear", (None,))[0]
                for k, (c, h, o, clean) in res.items():
                    nbytes = methods[k][1]
                    ratio = f"{base / c:.2f}x" if base else "-"
                    print(f"| {name} | {N}x{K} | {M} | {k} | {c * 1e6:.1f}{'' if clean else '*'} | "
                          f"{nbytes / c / 1e9:.1f} | {2 * M * N * K / c / 1e9:.1f} | {h * 1e6:.1f} | {ratio} | "
                          f"{100 * o:.0f} |", flush=True)
    if not args.no_model:
        model_sweep(selected, args.rounds * 2, args.tokens)


if __name__ == "__main__":
    main()
