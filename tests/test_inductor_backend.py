"""The inductor backend: IR -> FX -> Inductor, checked against the reference interpreter.

Graphs are built by hand with kiln.ir and kept tiny (the machine is shared): a 2-layer toy
transformer in the stateful form (tokens, positions, caches) -> (logits, caches'), and small
graphs that send every elementwise, reduction and shape op through the lowering.
"""

from __future__ import annotations

import pytest
import torch

from kiln.backends.executable import BackendOptions
from kiln.backends.inductor import (
    FX_LOWERINGS,
    AOTIExecutable,
    FeedError,
    LoweringError,
    UnsupportedOpError,
    check_lowering_table,
    graph_to_fx,
    load,
    lower,
)
from kiln.ir import Graph, TensorType, all_ops, run_graph, symbol, to_torch

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 48, 32, 4, 2, 8, 40
MAX_BATCH, MAX_SEQ = 2, 32


def _rotate(g: Graph, x, cos, sin):
    """Rotary embedding spelled with IR elementwise/shape ops: x*cos + rotate_half(x)*sin."""
    half = HEAD_DIM // 2
    first = g.call("slice", x, axis=3, start=0, end=half)
    second = g.call("slice", x, axis=3, start=half)
    rotated = g.call("concat", g.call("neg", second), first, axis=-1)
    return g.call("add", g.call("mul", x, cos), g.call("mul", rotated, sin))


def build_toy_transformer(layers: int = 2, window: int = 0, softcap: float = 0.0, seed: int = 0) -> Graph:
    """A stateful Llama-like LM: embedding, RMSNorm, GQA attention with RoPE over KV buffers, SwiGLU."""
    torch.manual_seed(seed)
    g = Graph()
    g.add_symbol("batch", 1, MAX_BATCH)
    g.add_symbol("seq", 1, MAX_SEQ)
    batch, seq = symbol("batch"), symbol("seq")
    tokens = g.add_input("tokens", TensorType("i64", (batch, seq)))
    positions = g.add_input("positions", TensorType("i64", (batch, seq)))
    cache_type = TensorType("f32", (MAX_BATCH, KV_HEADS, MAX_SEQ, HEAD_DIM))
    caches = [g.add_input(f"cache.{kind}.{i}", cache_type) for i in range(layers) for kind in "kv"]

    def param(name, *shape, scale=0.2):
        return g.add_param(name, torch.randn(*shape) * scale)

    inv_freq = g.add_param("rope.inv_freq", 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = g.call(
        "mul", g.call("reshape", g.call("cast", positions, dtype="f32"), shape=[batch, 1, seq, 1]), inv_freq
    )
    angles = g.call("concat", angles, angles, axis=-1)
    cos, sin = g.call("cos", angles), g.call("sin", angles)

    x = g.call("embedding", param("embed", VOCAB, HIDDEN, scale=1.0), tokens)
    written = []
    for i in range(layers):
        h = g.call("rms_norm", x, param(f"l{i}.attn_norm", HIDDEN, scale=1.0), eps=1e-5)

        def heads(w, n, h=h):
            y = g.call("reshape", g.call("linear", h, w, None), shape=[batch, seq, n, HEAD_DIM])
            return g.call("permute", y, perm=[0, 2, 1, 3])

        q = _rotate(g, heads(param(f"l{i}.wq", HEADS * HEAD_DIM, HIDDEN), HEADS), cos, sin)
        k = _rotate(g, heads(param(f"l{i}.wk", KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS), cos, sin)
        v = heads(param(f"l{i}.wv", KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS)
        k_all = g.call("kv_write", caches[2 * i], k, positions)
        v_all = g.call("kv_write", caches[2 * i + 1], v, positions)
        written += [k_all, v_all]
        a = g.call("attention", q, k_all, v_all, None, positions, window=window, softcap=softcap)
        a = g.call("reshape", g.call("permute", a, perm=[0, 2, 1, 3]), shape=[batch, seq, HEADS * HEAD_DIM])
        x = g.call("add", x, g.call("linear", a, param(f"l{i}.wo", HIDDEN, HEADS * HEAD_DIM), None))
        h = g.call("rms_norm", x, param(f"l{i}.mlp_norm", HIDDEN, scale=1.0), eps=1e-5)
        gate = g.call("silu", g.call("linear", h, param(f"l{i}.w_gate", FFN, HIDDEN), None))
        up = g.call("linear", h, param(f"l{i}.w_up", FFN, HIDDEN), param(f"l{i}.b_up", FFN))
        x = g.call("add", x, g.call("linear", g.call("mul", gate, up), param(f"l{i}.w_down", HIDDEN, FFN), None))
    x = g.call("rms_norm", x, param("final_norm", HIDDEN, scale=1.0), eps=1e-5)
    logits = g.call("linear", x, param("lm_head", VOCAB, HIDDEN), None, name="logits")
    g.outputs = [logits, *written]
    return g


class InterpreterOracle:
    """The stateful graph run by kiln.ir.run_graph, caches carried from call to call."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.caches = [torch.zeros(MAX_BATCH, KV_HEADS, MAX_SEQ, HEAD_DIM) for _ in graph.inputs[2:]]

    def run(self, tokens, positions):
        logits, *self.caches = run_graph(self.graph, [tokens, positions, *self.caches])
        return logits


# -- every op through the lowering ----------------------------------------------------------
# A case is (inputs, build): inputs are "name: dtype[dims]" where dtype `f32+` means positive
# floats and `i64<N` integers in [0, N); build(g, *values) appends the op and returns its output.
OP_CASES = {
    **{
        op: (["a: f32[batch, 3]", "b: f32[3]"], lambda g, a, b, op=op: g.call(op, a, b))
        for op in ("add", "sub", "mul", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge")
    },
    "div": (["a: f32[batch, 3]", "b: f32+[batch, 3]"], lambda g, a, b: g.call("div", a, b)),
    "pow": (["a: f32+[batch, 3]", "b: f32[3]"], lambda g, a, b: g.call("pow", a, b)),
    **{
        op: (["a: bool[batch, 3]", "b: bool[batch, 3]"], lambda g, a, b, op=op: g.call(op, a, b))
        for op in ("logical_and", "logical_or")
    },
    **{
        op: (["x: f32[batch, seq]"], lambda g, x, op=op: g.call(op, x))
        for op in ("neg", "exp", "abs", "tanh", "sin", "cos", "erf", "sigmoid", "relu", "silu")
    },
    **{
        op: (["x: f32+[batch, seq]"], lambda g, x, op=op: g.call(op, x))
        for op in ("log", "sqrt", "rsqrt", "reciprocal")
    },
    "gelu": (["x: f32[batch, seq]"], lambda g, x: g.call("gelu", x, approximate="tanh")),
    "logical_not": (["x: bool[batch, 3]"], lambda g, x: g.call("logical_not", x)),
    "where": (["c: bool[batch, 3]", "a: f32[batch, 3]", "b: f32[3]"], lambda g, c, a, b: g.call("where", c, a, b)),
    "cast": (["x: f32[batch, 3]"], lambda g, x: g.call("cast", x, dtype="i64")),
    "sum": (["x: f32[batch, seq, 3]"], lambda g, x: g.call("sum", x, axes=[1, 2])),
    "mean": (["x: f32[batch, seq, 3]"], lambda g, x: g.call("mean", x, axes=[-1], keepdim=True)),
    "max": (["x: f32[batch, seq, 3]"], lambda g, x: g.call("max", x, axes=[1])),
    "any": (["x: bool[batch, seq]"], lambda g, x: g.call("any", x, axes=[1])),
    "cumsum": (["x: i64<4[batch, seq]"], lambda g, x: g.call("cumsum", x, axis=1)),
    "softmax": (["x: f32[batch, seq]"], lambda g, x: g.call("softmax", x, axis=-1)),
    "reshape": (["x: f32[batch, seq, 4]"], lambda g, x: g.call("reshape", x, shape=[batch_, 2 * seq_, 2])),
    "permute": (["x: f32[batch, seq, 3]"], lambda g, x: g.call("permute", x, perm=[2, 0, 1])),
    "slice": (["x: f32[batch, seq, 3]"], lambda g, x: g.call("slice", x, axis=-2, start=1, end=seq_ - 1)),
    "concat": (["a: f32[batch, seq]", "b: f32[batch, 2]"], lambda g, a, b: g.call("concat", a, b, axis=1)),
    "expand": (["x: f32[batch, 1, 3]", "y: f32[seq]"], lambda g, x, y: g.call("expand", x, shape=[batch_, seq_, 3])),
    "index": (["x: f32[5, 3]", "i: i64<5[batch, seq]"], lambda g, x, i: g.call("index", x, i)),
    "arange": (["x: f32[batch, seq]"], lambda g, x: g.call("arange", start=1, end=seq_ + 2, step=2)),
    "full": (["x: f32[batch, seq]"], lambda g, x: g.call("full", shape=[batch_, seq_ * 2], value=1.5)),
    "linear": (["x: f32[batch, seq, 4]", "w: f32[3, 4]", "b: f32[3]"], lambda g, x, w, b: g.call("linear", x, w, b)),
    "matmul": (["a: f32[batch, seq, 4]", "b: f32[4, 3]"], lambda g, a, b: g.call("matmul", a, b)),
    "embedding": (["w: f32[6, 4]", "i: i64<6[batch, seq]"], lambda g, w, i: g.call("embedding", w, i)),
    # K = 32 is below Kiln's int4 kernel's minimum (64): the dequantizing form, exact like the reference.
    "linear_q": (
        ["x: f32[batch, seq, 32]", "q: u8<256[3, 16]", "s: f32[3, 2]", "z: u8<16[3, 2]", "b: f32[3]"],
        lambda g, x, q, s, z, b: g.call("linear_q", x, q, s, z, b, bits=4, group_size=16),
    ),
    "embedding_q": (
        ["q: i8<100[6, 4]", "s: f32[6, 1]", "i: i64<6[batch, seq]"],
        lambda g, q, s, i: g.call("embedding_q", q, s, i, bits=8, group_size=4),
    ),
    "layer_norm": (
        ["x: f32[batch, seq, 4]", "w: f32[4]", "b: f32[4]"],
        lambda g, x, w, b: g.call("layer_norm", x, w, b, eps=1e-5),
    ),
    "rms_norm": (
        ["x: f32[batch, seq, 4]", "w: f32[4]"],
        lambda g, x, w: g.call("rms_norm", x, w, eps=1e-6, offset=1.0),
    ),
    "add_rms_norm": (
        ["x: f32[batch, seq, 4]", "r: f32[batch, seq, 4]", "w: f32[4]"],  # both outputs used
        lambda g, x, r, w: g.call("add", *g.call("add_rms_norm", x, r, w, eps=1e-6, offset=1.0)),
    ),
    "rope": (
        ["x: f32[batch, 4, seq, 8]", "p: i64<16[batch, seq]", "c: f32[16, 3]", "s: f32[16, 3]"],
        lambda g, x, p, c, s: g.call("rope", x, p, c, s),
    ),  # partial: 6 of 8 dims rotate
    "attention": (
        ["q: f32[batch, 4, seq, 8]", "k: f32[batch, 2, seq, 8]", "v: f32[batch, 2, seq, 8]"],
        lambda g, q, k, v: g.call("attention", q, k, v, None, None, causal=True),
    ),
    "attention_window_positions": (
        ["q: f32[batch, 4, seq, 8]", "k: f32[3, 2, 6, 8]", "v: f32[3, 2, 6, 8]", "p: i64<6[batch, seq]"],
        lambda g, q, k, v, p: g.call("attention", q, k, v, None, p, window=2, scale=0.3),
    ),
    "attention_softcap_bool_mask": (
        [
            "q: f32[batch, 2, seq, 8]",
            "k: f32[batch, 2, 5, 8]",
            "v: f32[batch, 2, 5, 8]",
            "m: bool[batch, 1, seq, 5]",
            "p: i64<5[batch, seq]",
        ],
        lambda g, q, k, v, m, p: g.call("attention", q, k, v, m, p, softcap=2.0),
    ),
    "attention_float_mask": (
        ["q: f32[batch, 4, seq, 8]", "k: f32[batch, 2, seq, 8]", "v: f32[batch, 2, seq, 8]", "m: f32[seq, seq]"],
        lambda g, q, k, v, m: g.call("attention", q, k, v, m, None, causal=True, window=2),
    ),
    "attention_alibi_positions": (
        ["q: f32[batch, 4, seq, 8]", "k: f32[3, 2, 6, 8]", "v: f32[3, 2, 6, 8]", "p: i64<6[batch, seq]"],
        lambda g, q, k, v, p: g.call("attention", q, k, v, None, p, alibi=(0.5, 0.25, 0.125, 0.0625)),
    ),
    "attention_alibi_causal_bool_mask": (
        [
            "q: f32[batch, 2, seq, 8]",
            "k: f32[batch, 1, seq, 8]",
            "v: f32[batch, 1, seq, 8]",
            "m: bool[batch, 1, seq, seq]",
        ],
        lambda g, q, k, v, m: g.call("attention", q, k, v, m, None, causal=True, alibi=(0.5, 0.125)),
    ),
    "topk": (
        ["x: f32[batch, seq, 6]"],  # both outputs used: values + indices
        lambda g, x: g.call("add", *(lambda v, i: (v, g.call("cast", i, dtype="f32")))(*g.call("topk", x, k=2))),
    ),
    "gathered_matmul": (  # experts as an input: Kiln's in-place product (a parameter is packed instead)
        ["w: f32[4, 5, 3]", "i: i64<4[batch]", "x: f32[batch, 3, 2]"],
        lambda g, w, i, x: g.call("gathered_matmul", w, i, x),
    ),
    "gathered_matmul_q": (  # experts as inputs: the gathering, dequantizing form (parameters take the kernels)
        ["q: u8<256[4, 3, 16]", "s: f32[4, 3, 2]", "i: i64<4[batch]", "x: f32[batch, 32, 2]", "z: u8<16[4, 3, 2]"],
        lambda g, q, s, i, x, z: g.call("gathered_matmul_q", q, s, i, x, z, bits=4, group_size=16),
    ),
    "kv_write": (
        ["c: f32[3, 2, 6, 8]", "n: f32[batch, 2, seq, 8]", "p: i64<6[batch, seq]"],
        lambda g, c, n, p: g.call("kv_write", c, n, p),
    ),
    "kv_pages": (
        ["pool: f32[5, 2, 4, 8]", "table: i32<5[batch, 3]"],
        lambda g, pool, table: g.call("kv_pages", pool, table),
    ),
    "kv_quantize": (  # both outputs used: the codes times their scales
        ["x: f32[batch, 2, seq, 8]"],
        lambda g, x: (lambda codes, scales: g.call("mul", g.call("cast", codes, dtype="f32"), scales))(
            *g.call("kv_quantize", x)
        ),
    ),
    # A world of one rank (the identity); several ranks are tested by test_tensor_parallel.py.
    "all_reduce": (["x: f32[batch, seq, 3]"], lambda g, x: g.call("all_reduce", x, world_size=1)),
    "all_gather": (["x: f32[batch, seq, 3]"], lambda g, x: g.call("all_gather", x, axis=-1, world_size=1)),
}
batch_, seq_ = symbol("batch"), symbol("seq")


def _parse_input(spec: str):
    name, type_text = (s.strip() for s in spec.split(":"))
    dtype, dims = type_text.split("[")
    dims = tuple(symbol(d.strip()) if d.strip().isalpha() else int(d) for d in dims.rstrip("]").split(","))
    return name, dtype, dims


def _random_feed(dtype: str, shape) -> torch.Tensor:
    if "<" in dtype:  # integers below a bound: "i64<6", "u8<16"
        name, high = dtype.split("<")
        return torch.randint(0, int(high), shape, dtype=to_torch(name))
    if dtype == "bool":
        return torch.rand(shape) > 0.5
    x = torch.randn(shape)
    return x.abs() + 0.5 if dtype == "f32+" else x


def build_op_graph(cases: dict) -> Graph:
    """One graph holding every case, inputs prefixed by the case name, outputs in case order."""
    g = Graph()
    g.add_symbol("batch", 1, 8)
    g.add_symbol("seq", 1, 16)
    for case, (inputs, build) in cases.items():
        values = []
        for spec in inputs:
            name, dtype, dims = _parse_input(spec)
            values.append(g.add_input(f"{case}.{name}", TensorType(dtype.split("<")[0].rstrip("+"), dims)))
        g.outputs.append(build(g, *values))
    return g


def random_feeds(graph: Graph, cases: dict, batch: int, seq: int) -> list[torch.Tensor]:
    specs = [_parse_input(spec) for inputs, _ in cases.values() for spec in inputs]
    sizes = {"batch": batch, "seq": seq}
    return [
        _random_feed(dtype, [sizes[str(d)] if not isinstance(d, int) else d for d in dims]) for _, dtype, dims in specs
    ]


def test_every_registered_op_has_a_lowering_and_a_case():
    check_lowering_table()
    used = {node.op for node in build_op_graph(OP_CASES).nodes}
    assert used == set(all_ops()), f"ops without a test case: {sorted(set(all_ops()) - used)}"


def test_a_missing_lowering_is_an_error_naming_the_op(monkeypatch):
    monkeypatch.delitem(FX_LOWERINGS, "rms_norm")
    with pytest.raises(UnsupportedOpError, match="rms_norm"):
        graph_to_fx(build_op_graph({"rms_norm": OP_CASES["rms_norm"]}))


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_each_op_lowers_to_fx_like_the_interpreter_at_two_sizes(case):
    cases = {case: OP_CASES[case]}
    graph = build_op_graph(cases)
    module = graph_to_fx(graph)
    for batch, seq in ((2, 3), (1, 5)):  # one module: symbolic attrs must follow the inputs' sizes
        feeds = random_feeds(graph, cases, batch, seq)
        expected = run_graph(graph, [f.clone() for f in feeds])
        actual = module(*feeds)
        for e, a in zip(expected, actual):
            assert a.dtype == e.dtype and a.shape == e.shape
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_a_registered_linear_lowering_replaces_f_linear_and_its_unpacked_weight(monkeypatch):
    from kiln.backends.inductor import lower_to_fx

    def transposed_weight_linear(b, node, args, attrs):  # stands in for torch.ops.kiln.linear_f32
        packed = b.add_constant(node.inputs[1].name + ".packed", b.constant(args[1]).t().contiguous())
        return b.call(torch.addmm, args[2], args[0], packed)

    monkeypatch.setattr(lower_to_fx, "LINEAR_LOWERINGS", [])
    lower_to_fx.register_linear_lowering(transposed_weight_linear)
    g = Graph()
    x = g.add_input("x", TensorType("f32", (symbol("batch"), 4)))
    g.add_symbol("batch", 1, 4)
    g.outputs = [g.call("linear", x, g.add_param("w", torch.randn(3, 4)), g.add_param("b", torch.randn(3)))]
    module = graph_to_fx(g)
    assert [name for name, _ in module.named_parameters()] == ["param_b", "param_w_packed"]
    feed = torch.randn(2, 4)
    torch.testing.assert_close(module(feed)[0], run_graph(g, [feed])[0])


def test_kv_write_on_a_cache_the_module_does_not_own_leaves_the_callers_tensor_alone():
    cases = {"kv_write": OP_CASES["kv_write"]}
    graph = build_op_graph(cases)
    feeds = random_feeds(graph, cases, 2, 3)
    before = feeds[0].clone()
    graph_to_fx(graph)(*feeds)
    assert torch.equal(feeds[0], before)


def test_all_ops_compiled_with_inductor_match_the_interpreter_with_dynamic_sizes():
    graph = build_op_graph(OP_CASES)
    compiled = torch.compile(graph_to_fx(graph), backend="inductor", dynamic=True)
    for batch, seq in ((2, 4), (3, 6)):
        feeds = random_feeds(graph, OP_CASES, batch, seq)
        expected = run_graph(graph, [f.clone() for f in feeds])
        with torch.no_grad():
            actual = compiled(*feeds)
        for case, e, a in zip(OP_CASES, expected, actual):
            assert a.dtype == e.dtype and a.shape == e.shape, case
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=lambda m, case=case: f"{case}: {m}")


# -- the stateful executable ----------------------------------------------------------------
OPTIONS = BackendOptions(max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, threads=1)
PREFILL = (torch.tensor([[5, 9, 2, 7], [3, 3, 8, 1]]), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))


def decode_feeds(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 2, one token per row, rows at different positions (4 + step and 8 + step)."""
    return torch.tensor([[step % VOCAB], [(7 * step + 3) % VOCAB]]), torch.tensor([[4 + step], [8 + step]])


@pytest.fixture(scope="module", autouse=True)
def restore_thread_count():
    """Lowering applies options.threads process-wide; give other test modules theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def toy():
    """A 2-layer toy transformer and its compiled executable, shared to keep compiles few."""
    graph = build_toy_transformer()
    return graph, lower(graph, OPTIONS)


def test_prefill_then_decode_matches_the_interpreter(toy):
    graph, executable = toy
    executable.reset()
    oracle = InterpreterOracle(graph)
    for feeds in [PREFILL] + [decode_feeds(step) for step in range(4)]:
        torch.testing.assert_close(executable.run(*feeds), oracle.run(*feeds), atol=1e-4, rtol=1e-4)
    for mine, expected in zip(executable.caches, oracle.caches):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)


def test_decoding_twenty_steps_compiles_a_bounded_number_of_times(toy):
    _, executable = toy
    executable.reset()
    executable.run(*PREFILL)
    executable.run(*decode_feeds(0))
    compiled = executable.compile_count
    for step in range(1, 21):
        executable.run(*decode_feeds(step))
    executable.run(PREFILL[0][:, :3], PREFILL[1][:, :3])  # another prompt length: seq is dynamic
    assert executable.compile_count == compiled <= 2


def test_kv_write_updates_the_executables_buffers_in_place(toy):
    _, executable = toy
    executable.reset()
    addresses = [c.data_ptr() for c in executable.caches]
    executable.run(*decode_feeds(0))
    assert [c.data_ptr() for c in executable.caches] == addresses
    written = executable.caches[0][:, :, [4, 8]]
    assert written[0, :, 0].abs().sum() > 0 and written[1, :, 1].abs().sum() > 0
    assert executable.caches[0][0, :, 8].abs().sum() == 0  # row 0 wrote only position 4
    executable.reset()
    assert all(c.abs().sum() == 0 for c in executable.caches)


def test_run_rejects_batches_and_positions_outside_the_buffers(toy):
    _, executable = toy
    with pytest.raises(FeedError, match="max_batch"):
        executable.run(torch.zeros(3, 1, dtype=torch.int64), torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(FeedError, match="positions"):
        executable.run(torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), MAX_SEQ))


def test_a_cache_input_read_by_anything_but_kv_write_is_rejected():
    g = Graph()
    q = g.add_input("q", TensorType("f32", (1, 2, 1, 8)))
    cache = g.add_input("cache.k.0", TensorType("f32", (1, 2, 4, 8)))
    g.outputs = [g.call("attention", q, cache, cache, None, None)]
    with pytest.raises(LoweringError, match="cache.k.0"):
        graph_to_fx(g, state={"cache.k.0": torch.zeros(1, 2, 4, 8)})


def test_save_then_load_runs_the_aoti_package_without_compiling(tmp_path):
    graph = build_toy_transformer(layers=1, seed=1)
    files = lower(graph, OPTIONS).save(tmp_path)
    assert all((tmp_path / name).is_file() for name in files)
    loaded = load(tmp_path, graph, graph.weights, OPTIONS)
    assert isinstance(loaded, AOTIExecutable) and loaded.compile_count == 0
    oracle = InterpreterOracle(graph)
    feeds = [PREFILL, *(decode_feeds(step) for step in range(3)), (torch.tensor([[4]]), torch.tensor([[7]]))]
    for tokens, positions in feeds:  # batch 2 prefill and decode, then batch 1: one package
        torch.testing.assert_close(loaded.run(tokens, positions), oracle.run(tokens, positions), atol=1e-4, rtol=1e-4)
    loaded.reset()
    torch.testing.assert_close(loaded.run(*PREFILL), InterpreterOracle(graph).run(*PREFILL), atol=1e-4, rtol=1e-4)
    assert loaded.save(tmp_path / "copy") == files and (tmp_path / "copy" / files[0]).is_file()


def test_a_package_of_the_slab_layout_loads_as_it_was_compiled(tmp_path, monkeypatch):
    """Artifacts compiled before the panels name the slab kernels' constants; the package records
    its fp32 layout and a load lowers the same one, whatever KILN_LINEAR_LAYOUT says now."""
    import json

    from kiln.backends.inductor import fast_linear

    if not fast_linear.kernel_available():
        pytest.skip("the GEMV kernel cannot be built here")
    graph = build_toy_transformer(layers=1, seed=2)
    monkeypatch.setenv(fast_linear.LAYOUT_SWITCH, "slabs")
    lower(graph, OPTIONS).save(tmp_path)
    assert json.loads((tmp_path / "inductor.json").read_text())["f32_linear"] == "slabs"
    monkeypatch.delenv(fast_linear.LAYOUT_SWITCH)
    loaded = load(tmp_path, graph, graph.weights, OPTIONS)
    torch.testing.assert_close(loaded.run(*PREFILL), InterpreterOracle(graph).run(*PREFILL), atol=1e-4, rtol=1e-4)


def test_loading_a_package_with_another_graph_says_what_differs(tmp_path):
    from kiln.backends.inductor import PackageError

    (tmp_path / "inductor.json").write_text('{"format": 1, "torch": "0.0"}')
    (tmp_path / "inductor.pt2").write_bytes(b"")
    with pytest.raises(PackageError, match="torch 0.0"):
        load(tmp_path, build_toy_transformer(layers=1), None, OPTIONS)


def test_a_load_removes_the_staging_left_by_a_process_killed_during_its_own_load(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from kiln.backends.inductor import aoti_package

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"kiln_aoti_load_{gone.stdout.strip()}_abc" / "aotinductor_x"
    dead.mkdir(parents=True)
    (dead / "wrapper.so").write_bytes(b"\0")
    live = tmp_path / f"kiln_aoti_load_{os.getpid()}_def"  # a load in flight in a process still running
    live.mkdir()
    aoti_package._remove_stale_staging()
    assert not dead.parent.exists() and live.is_dir()
