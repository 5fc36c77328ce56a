"""Linear (GEMV / small-M / prefill) kernels on CPU for SmolLM2-135M shapes, 2 threads.

    python bench/gemv.py                      # shapes x M = 1, 4, 64 + whole-model decode sweep
    python bench/gemv.py --quick              # no compiled (Inductor) whole-model variants
    python bench/gemv.py --inductor           # + per-shape one-linear Inductor modules, onnxruntime
    python bench/gemv.py --m 1 --shapes q/o,lm_head --methods F.linear,kiln --no-model
    python bench/gemv.py --model-only         # only the whole-model decode sweep

Methods: F.linear / torch.mv (MKL on W [N, K]); mm(x,Wt) (MKL on W.t().contiguous());
mkldnn_packed (oneDNN _reorder_linear_weight + _linear_pointwise, what Inductor freezing emits);
kiln (kiln::linear_f32 with pack_linear_weight's auto layout); kiln(kn) (the AVX2 kernel forced on
every shape); int8pack_mm (aten._weight_int8pack_mm); kiln_i8 (kiln::linear_i8); inductor:* and
ort_mlas (onnxruntime MatMul) with --inductor.

1. Per shape x M x method. "cold": back-to-back calls that rotate through enough copies of the
   weight (>= 256 MB) that every call streams its weight from DRAM, as in decode where 538 MB of
   weights stream per token ("rot"); for compiled one-linear modules / onnxruntime, which own one
   weight, each call follows a 256 MB cache flush ("flush": also evicts the Python and wrapper
   working set, so it overstates them). "hot": the same weight again and again (L2/L3-resident:
   per-call overhead and compute). GB/s = weight bytes / cold time.
2. Whole-model decode sweep (M = 1): one token's linears of SmolLM2-135M in order, 30 layers x
   (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) + lm_head 49152x576, each with its
   own weights (538 MB fp32), eager and as one torch.compile graph (Inductor default, freezing,
   max-autotune C++ GEMM; the same graph on Kiln's ops).

Contention: the machine may be shared. Each measurement records the CPU time that *other*
processes used while it ran (/proc/stat minus this process); rounds are interleaved across
methods and repeated while contended; the median over rounds with < 8% foreign CPU is reported
("other%" = mean foreign load over all rounds; "*" = no clean round, number unreliable). With 2
threads on 2 cores, one foreign busy core turns each parallel region into a scheduler time slice
(~8 ms here), so contended numbers are meaningless, not just noisy.
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


def hot_sample(fn, n, budget_s=1.0, pre=None):
    """Median time of fn() over up to n calls (>= 3, stops after budget_s); pre() runs untimed
    before each call."""
    ts = []
    t0 = time.perf_counter()
    for _ in range(n):
        if len(ts) >= 3 and time.perf_counter() - t0 > budget_s:
            break
        if pre is not None:
            pre()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(methods: dict, rounds: int, cold_n: int, hot_n: int, max_rounds: int = 0):
    """methods: name -> ((cold_fn, pre_fn or None), hot_fn). Interleaved rounds (more, up to max_rounds, while a
    method has no round with < MAX_OTHER foreign load); returns name -> (cold_s, hot_s, other, clean)."""
    for (cold, _), hot in methods.values():
        for _ in range(3):
            cold()
            hot()
    rec = {k: [] for k in methods}
    r = 0
    while r < rounds or (r < max_rounds and any(all(o >= MAX_OTHER for *_, o in v) for v in rec.values())):
        r += 1
        for k, ((cold, pre), hot) in methods.items():
            if r > rounds and any(o < MAX_OTHER for *_, o in rec[k]):
                continue
            with Meter() as m:
                c = hot_sample(cold, cold_n, pre=pre)  # rotates weights, or flushes (untimed) first
                h = hot_sample(hot, hot_n)
            rec[k].append((c, h, m.other))
    out = {}
    for k, v in rec.items():
        clean = [r for r in v if r[2] < MAX_OTHER]
        use = clean or v
        out[k] = (
            statistics.median(r[0] for r in use),
            statistics.median(r[1] for r in use),
            statistics.mean(r[2] for r in v),
            bool(clean),
        )
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
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    wt = numpy_helper.from_array(w.t().contiguous().numpy(), "Wt")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "Wt"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, w.shape[0]])],
        [wt],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 9)  # onnx may be newer than onnxruntime's max
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    xn = np.random.randn(M, K).astype(np.float32)
    return lambda: sess.run(None, {"x": xn})


ROTATE_BYTES = 256e6  # per method: enough distinct weight copies that none is cached when reused


def build_methods(N, K, M, selected, want_compiled):
    """name -> (cold_fn, hot_fn, weight bytes, how). Eager methods rotate through copies of the
    weight ("rot"): back-to-back calls, each on weights not in any cache, as in decode. Compiled
    one-linear modules and onnxruntime own a single frozen weight: cold = after a 256 MB cache
    flush ("flush"; also evicts the Python/wrapper working set, so it overstates their cost)."""
    from kiln.backends.inductor import gemv_kernel as gk

    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g)
    f32, i8 = N * K * 4, N * K + 4 * N
    copies = max(2, int(ROTATE_BYTES // f32))
    base_w = torch.randn(N, K, generator=g) * 0.02
    m: dict[str, tuple] = {}

    def want(name):
        return not selected or name in selected

    def add_rot(name, make_w, fn, nbytes):
        if not want(name):
            return
        try:
            ws = [make_w(base_w if i == 0 else base_w + 1e-3 * i) for i in range(copies)]
            fn(ws[0])
        except Exception as e:  # noqa: BLE001 - report, keep going
            print(f"  [{name}] unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            return
        i = [0]

        def cold():
            i[0] = (i[0] + 1) % copies
            fn(ws[i[0]])

        m[name] = ((cold, None), lambda: fn(ws[0]), nbytes, "rot")

    def add_flush(name, mk, nbytes):
        if not want(name):
            return
        try:
            fn = mk()
            fn()
        except Exception as e:  # noqa: BLE001 - report, keep going
            print(f"  [{name}] unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            return

        m[name] = ((fn, flush_caches), fn, nbytes, "flush")

    ident = lambda w: w.clone()  # noqa: E731
    add_rot("F.linear", ident, lambda w: F.linear(x, w), f32)
    if M == 1:
        add_rot("torch.mv", ident, lambda w: torch.mv(w, x[0]), f32)
    add_rot("mm(x,Wt)", lambda w: w.t().contiguous(), lambda w: torch.mm(x, w), f32)
    add_rot(
        "mkldnn_packed",
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, M),
        lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        f32,
    )
    add_rot("kiln", lambda w: gk.pack_linear_weight(w), lambda w: torch.ops.kiln.linear_f32(x, w, None), f32)
    add_rot("kiln(kn)", lambda w: gk.pack_linear_weight(w, "kn"), lambda w: torch.ops.kiln.linear_f32(x, w, None), f32)
    add_rot(
        "int8pack_mm",
        lambda w: (lambda q: (q[0].t().contiguous(), q[1]))(gk.pack_linear_weight_int8(w)),
        lambda p: torch._weight_int8pack_mm(x, p[0], p[1]),
        i8,
    )
    add_rot("kiln_i8", gk.pack_linear_weight_int8, lambda p: torch.ops.kiln.linear_i8(x, p[0], p[1], None), i8)
    if want_compiled:
        for mode in ("default", "freeze", "freeze+cpp_wrapper", "max_autotune_cpp"):

            def mk(mode=mode):
                cm = _compiled_linear(base_w, M, K, mode)
                return lambda: cm(x)

            add_flush(f"inductor:{mode}", mk, f32)
        add_flush("ort_mlas", lambda: _ort_matmul(base_w, M, K), f32)

        def mk_kc():
            wt = gk.pack_linear_weight(base_w)
            f = torch.compile(lambda a: torch.ops.kiln.linear_f32(a, wt, None), fullgraph=True, dynamic=False)
            f(x)
            return lambda: f(x)

        add_flush("kiln:compiled", mk_kc, f32)
    return m


# ------------------------------------------------------------------ whole-model decode sweep
class _Linears(torch.nn.Module):
    """One decode token's linears as one graph: every weight applied to its input, all outputs
    returned (so nothing is dead code). kind: "linear" (F.linear on [N, K] params), "kiln"
    (kiln::linear_f32 on packed [K, N] buffers), "kiln_i8"."""

    def __init__(self, ws, kind):
        super().__init__()
        from kiln.backends.inductor import gemv_kernel as gk

        self.kind = kind
        self.ins = [w.shape[1] for w in ws]
        for i, w in enumerate(ws):
            if kind == "linear":
                self.register_parameter(f"w{i}", torch.nn.Parameter(w.clone(), requires_grad=False))
            elif kind == "kiln":
                self.register_buffer(f"w{i}", gk.pack_linear_weight(w))
            else:
                q, sc = gk.pack_linear_weight_int8(w)
                self.register_buffer(f"w{i}", q)
                self.register_buffer(f"s{i}", sc)

    def forward(self, x576, x1536):
        outs = []
        for i, k in enumerate(self.ins):
            x = x576 if k == 576 else x1536
            w = getattr(self, f"w{i}")
            if self.kind == "linear":
                outs.append(F.linear(x, w))
            elif self.kind == "kiln":
                outs.append(torch.ops.kiln.linear_f32(x, w, None))
            else:
                outs.append(torch.ops.kiln.linear_i8(x, w, getattr(self, f"s{i}"), None))
        return tuple(outs)


def _compile_linears(ws, kind, mode):
    import torch._inductor.config as icfg

    mod = _Linears(ws, kind).eval()
    patches = {"freezing": mode in ("freeze", "max_autotune_cpp")}
    if mode == "max_autotune_cpp":
        patches.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")
    x576, x1536 = torch.randn(1, 576), torch.randn(1, 1536)
    torch._dynamo.reset()
    t = time.perf_counter()
    with icfg.patch(patches), torch.no_grad():
        cm = torch.compile(mod, fullgraph=True, dynamic=False)
        cm(x576, x1536)
    print(f"  compiled {kind}/{mode} in {time.perf_counter() - t:.0f}s", file=sys.stderr)

    def run():
        with torch.no_grad():
            cm(x576, x1536)

    return run


def model_sweep(selected, rounds, tokens, compiled):
    """One token = SmolLM2-135M's 121 decode linears, each with its own weights (538 MB fp32)."""
    from kiln.backends.inductor import gemv_kernel as gk

    layer = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    seq = layer * 30 + [(49152, 576)]
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, k, generator=g) * 0.02 for n, k in seq]
    total_f32 = sum(n * k * 4 for n, k in seq)
    total_i8 = sum(n * k + 4 * n for n, k in seq)
    xs = {k: torch.randn(1, k, generator=g) for k in (576, 1536)}
    fns: dict[str, tuple] = {}  # name -> (fn, bytes)

    def want(n):
        return not selected or n in selected

    def loop(items, fn):
        def token():
            for a, w in items:
                fn(a, w)

        return token

    if want("F.linear"):
        fns["F.linear"] = (loop([(xs[k], w) for (n, k), w in zip(seq, ws)], F.linear), total_f32)
    if want("mkldnn_packed"):
        items = [(xs[k], torch.ops.mkldnn._reorder_linear_weight(w, 1)) for (n, k), w in zip(seq, ws)]
        fns["mkldnn_packed"] = (
            loop(items, lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")),
            total_f32,
        )
    if want("mm(x,Wt)") or want("kiln"):
        packed = [(xs[k], gk.pack_linear_weight(w)) for (n, k), w in zip(seq, ws)]
        if want("mm(x,Wt)"):
            fns["mm(x,Wt)"] = (loop(packed, torch.mm), total_f32)
        if want("kiln"):
            fns["kiln"] = (loop(packed, lambda a, w: torch.ops.kiln.linear_f32(a, w, None)), total_f32)
    if want("int8pack_mm") or want("kiln_i8"):
        q = [gk.pack_linear_weight_int8(w) for w in ws]
        if want("int8pack_mm"):
            items = [(xs[k], (wq.t().contiguous(), sc)) for (n, k), (wq, sc) in zip(seq, q)]
            fns["int8pack_mm"] = (loop(items, lambda a, p: torch._weight_int8pack_mm(a, p[0], p[1])), total_i8)
        if want("kiln_i8"):
            items = [(xs[k], p) for (n, k), p in zip(seq, q)]
            fns["kiln_i8"] = (loop(items, lambda a, p: torch.ops.kiln.linear_i8(a, p[0], p[1], None)), total_i8)
        del q
    if compiled:
        for kind, mode, nbytes in (
            ("linear", "default", total_f32),
            ("linear", "freeze", total_f32),
            ("linear", "max_autotune_cpp", total_f32),
            ("kiln", "default", total_f32),
            ("kiln", "freeze", total_f32),
            ("kiln_i8", "freeze", total_i8),
        ):
            name = f"inductor:{mode}" if kind == "linear" else f"inductor:{mode}+{kind}"
            if want(name) or want("compiled"):
                try:
                    fns[name] = (_compile_linears(ws, kind, mode), nbytes)
                except Exception as e:  # noqa: BLE001 - report, keep going
                    print(
                        f"  [{name}] unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr
                    )
    del ws

    rec = {k: [] for k in fns}
    for f, _ in fns.values():
        f()
    r = 0
    while r < rounds or (r < 3 * rounds and any(all(o >= MAX_OTHER for _, o in v) for v in rec.values())):
        r += 1
        for k, (f, _) in fns.items():
            if r > rounds and any(o < MAX_OTHER for _, o in rec[k]):
                continue
            with Meter() as m:
                t = hot_sample(f, tokens, budget_s=10.0)  # weights >> cache: every token streams them from DRAM
            rec[k].append((t, m.other))
    print(f"\n## whole-model decode sweep (M=1, {len(seq)} linears/token, fp32 weights {total_f32 / 1e6:.0f} MB)")
    print("| method | ms/token | GB/s | tok/s (linears only) | vs F.linear | other% |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for k, v in rec.items():
        clean = [t for t, o in v if o < MAX_OTHER]
        t = statistics.median(clean or [t for t, o in v])
        base = base or (t if k == "F.linear" else None)
        ratio = f"{base / t:.2f}x" if base else "-"
        mark = "" if clean else "*"
        print(
            f"| {k} | {t * 1e3:.2f}{mark} | {fns[k][1] / t / 1e9:.1f} | {1 / t:.1f} | {ratio} | "
            f"{100 * statistics.mean(o for _, o in v):.0f} |",
            flush=True,
        )


def machine_line():
    model = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{model}; {os.cpu_count()} CPUs; torch {torch.__version__} "
        f"(capability {torch.backends.cpu.get_cpu_capability()}); threads {torch.get_num_threads()}; "
        f"loadavg {open('/proc/loadavg').read().split()[0]}; {platform.python_version()}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--m", default="1,4,64", help="comma-separated M values (rows of x)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--methods", default="", help="comma-separated subset of method names")
    ap.add_argument("--quick", action="store_true", help="no compiled whole-model variants")
    ap.add_argument(
        "--inductor",
        action="store_true",
        help="also per-shape one-linear Inductor modules and onnxruntime (slow compiles)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-rounds", type=int, default=8, help="extra rounds while contended")
    ap.add_argument("--cold", type=int, default=40, help="cold calls per round")
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
        print("\n| shape | N x K | M | method | cold us | GB/s | GFLOP/s | hot us | vs F.linear | cold by | other% |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|")
        for name in args.shapes.split(","):
            N, K = SHAPES[name]
            for M in map(int, args.m.split(",")):
                methods = build_methods(N, K, M, selected, args.inductor)
                res = measure({k: v[:2] for k, v in methods.items()}, args.rounds, args.cold, args.hot, args.max_rounds)
                base = res.get("F.linear", (None,))[0]
                for k, (c, h, o, clean) in res.items():
                    nbytes, how = methods[k][2], methods[k][3]
                    ratio = f"{base / c:.2f}x" if base else "-"
                    print(
                        f"| {name} | {N}x{K} | {M} | {k} | {c * 1e6:.1f}{'' if clean else '*'} | "
                        f"{nbytes / c / 1e9:.1f} | {2 * M * N * K / c / 1e9:.1f} | {h * 1e6:.1f} | {ratio} | "
                        f"{how} | {100 * o:.0f} |",
                        flush=True,
                    )
                del methods
    if not args.no_model:
        model_sweep(selected, args.rounds * 2, args.tokens, not args.quick)


if __name__ == "__main__":
    main()
