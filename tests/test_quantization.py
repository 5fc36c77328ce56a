"""Weight quantization: the linear_q layout, the schemes, the quantize passes (round-to-nearest
and AWQ-style scaling), the Inductor lowering, the compile option and the perplexity measure."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kiln.backends.executable import BackendOptions
from kiln.ir import Graph, TensorType, run_graph, symbol
from kiln.ir.ops.quantized import dequantize, expand_groups, pack_int4, unpack_int4
from kiln.passes.awq_scaling import awq_scale
from kiln.passes.quant_schemes import SCHEMES, UnknownSchemeError, get_scheme
from kiln.passes.quantize_phase import CalibrationError, quantization_passes
from kiln.passes.quantize_weights import quantize_weights
from kiln.passes.round_to_nearest import quantize_weight
from kiln.runtime.perplexity import perplexity, token_windows, window_nll

MAX_SEQ = 64


def rtn_schemes():
    return [s for s in SCHEMES.values() if s.method == "rtn"]


# -- the layout and the grids ---------------------------------------------------------------------
def test_int4_packing_puts_even_elements_in_the_low_nibble_and_round_trips():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6) and packed[0, 0] == q[0, 0] | (q[0, 1] << 4)
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("scheme", rtn_schemes(), ids=lambda s: s.name)
def test_each_scheme_rounds_every_weight_within_its_step(scheme):
    torch.manual_seed(0)
    w = torch.randn(48, 576) * torch.rand(48, 1)  # rows of different ranges; 576 % 128 != 0: a short last group
    group_size = scheme.group_size_for(576)
    q = quantize_weight(w, scheme.bits, group_size, scheme.symmetric)
    groups = -(-576 // group_size)
    assert q.qweight.shape == ((48, 576) if scheme.bits == 8 else (48, 288))
    assert q.qweight.dtype == (torch.int8 if scheme.bits == 8 else torch.uint8)
    assert q.scales.shape == (48, groups) and (q.zeros is None) == scheme.symmetric
    step = expand_groups(q.scales.abs(), group_size, 576)
    # Round-to-nearest: half a step, except that a symmetric 4-bit grid reaches one step less far
    # on the side opposite its largest magnitude (16 levels: -8..7).
    bound = 1.0 if scheme.bits == 4 and scheme.symmetric else 0.5
    assert ((q.dequantize() - w).abs() <= step * bound + 1e-6).all()
    assert torch.equal(q.dequantize(), dequantize(q.qweight, q.scales, q.zeros, scheme.bits, group_size))


def test_asymmetric_4bit_is_exact_on_weights_already_on_its_grid():
    torch.manual_seed(0)
    codes, scales = torch.randint(0, 16, (8, 64)), torch.rand(8, 2) + 0.1
    codes[:, [0, 32]], codes[:, [1, 33]] = 0, 15  # each group spans the whole grid (like llama.cpp's Q4_1)
    zeros = torch.randint(0, 16, (8, 2))
    w = (codes - expand_groups(zeros.float(), 32, 64)) * expand_groups(scales, 32, 64)
    q = quantize_weight(w, 4, 32, symmetric=False)
    assert torch.equal(q.zeros, zeros.to(torch.uint8))
    torch.testing.assert_close(q.dequantize(), w, atol=1e-5, rtol=1e-5)


def test_unknown_scheme_names_the_known_ones():
    with pytest.raises(UnknownSchemeError, match="known schemes: int8, int4-g32, int4-g64"):
        get_scheme("int3")


def test_awq_scheme_without_calibration_is_an_error():
    class Options:
        quantize, quantize_embeddings = "int4-g64-awq", False

    with pytest.raises(CalibrationError, match="calibration"):
        quantization_passes(Options)


# -- the pass on a tiny model --------------------------------------------------------------------
def copy_graph(graph: Graph) -> Graph:
    from kiln.ir import parse_graph, print_graph

    copy = parse_graph(print_graph(graph))
    copy.weights = dict(graph.weights)
    return copy


@pytest.fixture(scope="module")
def tiny_llama_captured(tiny_model_dirs):
    """The tiny llama (tied embeddings) as captured."""
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model

    return capture_causal_lm(load_model(tiny_model_dirs("llama")).model, max_batch=1, max_seq_len=MAX_SEQ)


@pytest.fixture(scope="module")
def tiny_llama_fused(tiny_llama_captured):
    """The tiny llama through canonicalize + fuse: the stateless graph the quantize phase sees."""
    from kiln.passes.pipeline import default_pipeline

    manager = default_pipeline(BackendOptions(max_seq_len=MAX_SEQ))
    manager.phases = [p for p in manager.phases if p[0] in ("canonicalize", "fuse")]
    return manager.run(copy_graph(tiny_llama_captured))


def logits(graph: Graph, tokens: torch.Tensor) -> torch.Tensor:
    return run_graph(graph, {"tokens": tokens, "positions": torch.arange(tokens.shape[1])[None]})[0]


def with_rounded_weights(graph: Graph, scheme, names) -> Graph:
    """A copy of `graph` whose weights `names` are replaced by their round-to-nearest values."""
    rounded = copy_graph(graph)
    for name in names:
        w = rounded.weights[name]
        q = quantize_weight(w, scheme.bits, scheme.group_size_for(w.shape[1]), scheme.symmetric)
        rounded.weights[name] = q.dequantize()
    return rounded


@pytest.mark.parametrize("name", ["int8", "int4-g32", "int4-g64-asym"])
def test_quantize_pass_rewrites_every_eligible_linear_into_the_rounded_model(tiny_llama_fused, name):
    scheme = get_scheme(name)
    graph = copy_graph(tiny_llama_fused)
    weights = [n.inputs[1].name for n in graph.nodes if n.op == "linear"]
    quantize_weights(graph, scheme)
    ops = [n.op for n in graph.nodes]
    assert ops.count("linear_q") == len(weights) - 1 and ops.count("linear") == 1  # the tied lm_head stays f32
    assert ops.count("embedding") == 1 and graph.meta["quantization"]["scheme"] == name
    assert not set(weights[:-1]) & set(graph.params)  # the f32 copies are dropped
    tokens = torch.randint(3, 500, (1, 12))
    expected = logits(with_rounded_weights(tiny_llama_fused, scheme, weights[:-1]), tokens)
    torch.testing.assert_close(logits(graph, tokens), expected, atol=1e-4, rtol=1e-4)


def test_quantize_embeddings_share_one_table_between_embedding_and_lm_head(tiny_llama_fused):
    scheme = get_scheme("int4-g32")
    graph = copy_graph(tiny_llama_fused)
    quantize_weights(graph, scheme, include_embeddings=True)
    ops = [n.op for n in graph.nodes]
    assert "linear" not in ops and "embedding" not in ops
    embedding = next(n for n in graph.nodes if n.op == "embedding_q")
    lm_head = [n for n in graph.nodes if n.op == "linear_q"][-1]
    assert embedding.inputs[0] is lm_head.inputs[1]
    tokens = torch.randint(3, 500, (1, 12))
    every_weight = {n.inputs[1].name for n in tiny_llama_fused.nodes if n.op == "linear"}
    expected = logits(with_rounded_weights(tiny_llama_fused, scheme, every_weight), tokens)
    torch.testing.assert_close(logits(graph, tokens), expected, atol=1e-4, rtol=1e-4)


def skewed_model(seed: int = 0) -> Graph:
    """tokens -> embedding -> rms_norm (two channels 30x the rest) -> linear -> add: AWQ's target
    case (the add keeps the linear from being the output projection, which stays f32)."""
    torch.manual_seed(seed)
    g = Graph()
    g.add_symbol("batch", 1, 4)
    g.add_symbol("seq", 1, 64)
    batch, seq = symbol("batch"), symbol("seq")
    tokens = g.add_input("tokens", TensorType("i64", (batch, seq)))
    g.add_input("positions", TensorType("i64", (batch, seq)))
    norm_weight = torch.ones(128)
    norm_weight[[3, 70]] = 30.0
    h = g.call("embedding", g.add_param("embed", torch.randn(100, 128)), tokens)
    h = g.call("rms_norm", h, g.add_param("norm", norm_weight), eps=1e-6)
    y = g.call("linear", h, g.add_param("proj", torch.randn(96, 128) * 0.05), None)
    g.outputs = [g.call("add", y, g.add_param("shift", torch.randn(96)), name="out")]
    return g


def test_awq_cuts_the_output_error_of_round_to_nearest_on_a_skewed_channel():
    scheme = get_scheme("int4-g64-awq")
    calibration, held_out = torch.randint(0, 100, (2, 64)), torch.randint(0, 100, (1, 64))
    reference = skewed_model()
    want = logits(reference, held_out)
    rtn = quantize_weights(skewed_model(), scheme)
    awq = quantize_weights(awq_scale(skewed_model(), scheme, calibration), scheme)
    assert [n.op for n in awq.nodes] == ["embedding", "rms_norm", "linear_q", "add"]  # 1/s folded into the norm
    rtn_error = (logits(rtn, held_out) - want).pow(2).mean()
    awq_error = (logits(awq, held_out) - want).pow(2).mean()
    assert awq_error < 0.5 * rtn_error, (awq_error, rtn_error)


def test_awq_scaling_keeps_the_results_before_rounding(tiny_llama_fused):
    graph = copy_graph(tiny_llama_fused)
    awq_scale(graph, get_scheme("int4-g32-awq"), torch.randint(3, 500, (2, 32)))
    assert graph.meta["awq"]["scaled"] > 0
    tokens = torch.randint(3, 500, (1, 12))
    torch.testing.assert_close(logits(graph, tokens), logits(tiny_llama_fused, tokens), atol=1e-4, rtol=1e-4)


# -- the Inductor lowering -----------------------------------------------------------------------
def quantized_linear_graph(bits: int, group_size: int, symmetric: bool, k: int = 128) -> Graph:
    torch.manual_seed(0)
    g = Graph()
    g.add_symbol("rows", 1, 16)
    x = g.add_input("x", TensorType("f32", (symbol("rows"), k)))
    q = quantize_weight(torch.randn(80, k), bits, group_size, symmetric)
    zeros = None if q.zeros is None else g.add_param("w.zeros", q.zeros)
    g.outputs = [
        g.call(
            "linear_q",
            x,
            g.add_param("w.q", q.qweight),
            g.add_param("w.scales", q.scales),
            zeros,
            g.add_param("b", torch.randn(80)),
            bits=bits,
            group_size=group_size,
        )
    ]
    return g


@pytest.mark.parametrize(
    "bits, group_size, symmetric, k",
    [(8, 128, True, 128), (4, 32, True, 128), (4, 64, False, 192), (4, 128, True, 192), (4, 16, False, 96)],
)
def test_inductor_lowering_of_linear_q_matches_the_interpreter(bits, group_size, symmetric, k):
    from kiln.backends.inductor import graph_to_fx

    graph = quantized_linear_graph(bits, group_size, symmetric, k)
    module = graph_to_fx(graph)
    for rows in (1, 3, 12):  # decode-sized kernels, and the dequantize + GEMM of prefill
        x = torch.randn(rows, k)
        want, got = run_graph(graph, [x])[0], module(x)[0]
        # Kiln's int4 kernel rounds x to int8 per block of 32 (as ORT's accuracy level 4): ~0.5%.
        assert ((got - want).norm() / want.norm()).item() < 0.012


@pytest.mark.parametrize("form", ["q8", "i8"])
def test_a_packaged_int8_form_is_lowered_as_recorded_whatever_this_cpu_picks(form):
    """An AOTInductor package names the constants of the 8-bit op it was compiled with, and its
    info records which (`int8_form_of`); a load lowers the same one on any host, an artifact older
    than linear_q8 ("i8") included."""
    from kiln.backends.inductor import graph_to_fx
    from kiln.backends.inductor.quantized_linear import int8_form_of, lowering_int8_as

    graph = quantized_linear_graph(8, 128, True, 128)
    with lowering_int8_as(form):
        module = graph_to_fx(graph)
    assert int8_form_of(module) == form
    x = torch.randn(3, 128)
    want, got = run_graph(graph, [x])[0], module(x)[0]
    assert ((got - want).norm() / want.norm()).item() < 0.012


@pytest.mark.parametrize("vnni", [True, False])
def test_int4_kernel_over_many_rows_equals_it_row_by_row(vnni):
    """Up to 128 rows of x (odd counts too) in one call: each panel of weight rows is staged once
    and every row of x runs over it (VNNI or AVX2 dot products; symmetric and zero-point weights).
    Same integer sums, the float steps summed in another order: equal to the one-row calls to fp32
    rounding; the tests above hold those to the dequantized reference."""
    from kiln.backends.inductor.quantized_linear import int4_kernel_available

    if not int4_kernel_available():
        pytest.skip("Kiln's int4 kernel does not build here")
    if vnni and not torch.ops.kiln.q4_use_vnni(True):
        pytest.skip("this CPU has no AVX-512 VNNI")
    torch.ops.kiln.q4_use_vnni(vnni)
    try:
        torch.manual_seed(5)
        for n, k, group_size, symmetric in [
            (67, 576, 32, True),
            (130, 192, 64, True),
            (40, 1536, 128, True),
            (33, 576, 32, False),
        ]:
            q = quantize_weight(torch.randn(n, k), 4, group_size, symmetric)
            bias = torch.randn(n)
            for rows in (2, 3, 8, 9, 17, 64, 128):
                x = torch.randn(rows, k)
                for half in (None, q.scales.half()) if symmetric else (None,):
                    got = torch.ops.kiln.linear_q4(x, q.qweight, q.scales, q.zeros, bias, group_size, half)
                    one_by_one = torch.cat(
                        [
                            torch.ops.kiln.linear_q4(x[i : i + 1], q.qweight, q.scales, q.zeros, bias, group_size, half)
                            for i in range(rows)
                        ]
                    )
                    assert torch.allclose(got, one_by_one, atol=1e-4, rtol=1e-5), (n, k, group_size, rows)
    finally:
        torch.ops.kiln.q4_use_vnni(True)


@pytest.mark.parametrize("group_size, k", [(32, 576), (64, 1536), (128, 576)])
def test_int4_kernel_symmetric_path_equals_its_zero_point_path_at_eight(group_size, k):
    """The symmetric kernel folds zero point 8 into each block's step; the general one subtracts
    the zero points per group after the dot. Same rounding of x, same sums: equal to fp32 noise."""
    from kiln.backends.inductor.quantized_linear import int4_kernel_available

    if not int4_kernel_available():
        pytest.skip("Kiln's int4 kernel does not build here")
    torch.manual_seed(3)
    q = quantize_weight(torch.randn(200, k), 4, group_size, symmetric=True)
    eights = torch.full(q.scales.shape, 8, dtype=torch.uint8)
    bias = torch.randn(200)
    for rows in (1, 3):
        x = torch.randn(rows, k)
        folded = torch.ops.kiln.linear_q4(x, q.qweight, q.scales, None, bias, group_size)
        general = torch.ops.kiln.linear_q4(x, q.qweight, q.scales, eights, bias, group_size)
        exact = torch.nn.functional.linear(x, dequantize(q.qweight, q.scales, None, 4, group_size), bias)
        assert torch.allclose(folded, general, atol=1e-4, rtol=1e-5)
        assert ((folded - exact).norm() / exact.norm()).item() < 0.012
        # f16 scales (what the lowering passes for symmetric weights): the same sums with the
        # scales rounded to half
        halved = torch.ops.kiln.linear_q4(x, q.qweight, q.scales, None, bias, group_size, q.scales.half())
        rounded = torch.ops.kiln.linear_q4(x, q.qweight, q.scales.half().float(), eights, bias, group_size)
        assert torch.allclose(halved, rounded, atol=1e-4, rtol=1e-5)


def test_awq_compile_to_an_inductor_artifact_records_the_scheme_and_its_calibration(tiny_model_dirs, tmp_path):
    import kiln
    from kiln.backends import reference

    path = kiln.compile(
        tiny_model_dirs("llama"),
        out=tmp_path / "q.kiln",
        backend="inductor",
        max_seq_len=MAX_SEQ,
        quantize="int4-g32-awq",
    )
    options = json.loads((path / "manifest.json").read_text())["options"]
    assert options["quantize"] == "int4-g32-awq" and options["quantize_embeddings"] is False
    assert options["calibration"].startswith("Moby-Dick chapters 2, 4, 5 (bundled")
    llm = kiln.load(path)  # the AOTInductor package, its int4 kernel calls through the proxy executor
    assert llm.graph.meta["awq"]["calibration_tokens"] == 4 * MAX_SEQ and llm.graph.meta["awq"]["scaled"] > 0
    assert sum(n.op == "linear_q" for n in llm.graph.nodes) == 8  # 2 layers of qkv, o, gate_up, down
    oracle = reference.lower(llm.graph, llm.executable.options)
    tokens = torch.randint(3, 500, (1, 10))
    # Up to 128 tokens a step runs Kiln's int4 kernel (prefill chunks, verification, decode), whose
    # int8-rounded activations (~0.5% per linear) this random model amplifies; longer prefill
    # dequantizes and runs one f32 GEMM (the interpreter's results).
    for start, end, tolerance in ((0, 9, 0.05), (9, 10, 0.05)):
        chunk, positions = tokens[:, start:end], torch.arange(start, end)[None]
        want, got = oracle.run(chunk, positions), llm.executable.run(chunk, positions)
        assert ((got - want).norm() / want.norm()).item() < tolerance


def test_onnxruntime_runs_per_channel_int8_of_a_wide_input_as_matmulnbits_blocks_of_256(exact_activations):
    """K = 1536 (SmolLM2's down projection): one int8 group per row, which MatMulNBits (blocks of
    at most 256) takes as 6 blocks sharing the row's scale."""
    from kiln.backends import onnxruntime as ort_backend
    from kiln.backends import reference

    torch.manual_seed(0)
    g = Graph()
    g.add_symbol("batch", 1, 1)
    g.add_symbol("seq", 1, 8)
    tokens = g.add_input("tokens", TensorType.parse("i64[batch, seq]"))
    g.add_input("positions", TensorType.parse("i64[batch, seq]"))
    q = quantize_weight(torch.randn(40, 1536), 8, 1536, symmetric=True)
    x = g.call("embedding", g.add_param("embed", torch.randn(32, 1536)), tokens)
    g.outputs = [
        g.call(
            "linear_q",
            x,
            g.add_param("w.q", q.qweight),
            g.add_param("w.scales", q.scales),
            None,
            None,
            name="logits",
            bits=8,
            group_size=1536,
        )
    ]
    options = BackendOptions(max_batch=1, max_seq_len=8)
    assert "MatMulNBits" in ort_backend.graph_to_onnx(g).op_types()
    chunk, positions = torch.randint(0, 32, (1, 5)), torch.arange(5)[None]
    expected = reference.lower(g, options).run(chunk, positions)
    torch.testing.assert_close(ort_backend.lower(g, options).run(chunk, positions), expected, atol=1e-3, rtol=1e-4)


def test_compile_with_an_unknown_scheme_fails_before_loading_the_model(tmp_path, capsys):
    from kiln.cli import compile_model_main

    assert compile_model_main([str(tmp_path / "no-model"), "-o", str(tmp_path / "x"), "--quantize", "int3"]) == 2
    assert "unknown quantization scheme 'int3'; known schemes: int8" in capsys.readouterr().err


def test_a_missing_calibration_file_is_an_error_before_the_model_loads(tmp_path, capsys):
    from kiln.cli import compile_model_main

    argv = [
        str(tmp_path / "no-model"),
        "-o",
        str(tmp_path / "x"),
        "--quantize",
        "int4-g64-awq",
        "--calibration",
        str(tmp_path / "missing.txt"),
    ]
    assert compile_model_main(argv) == 2
    assert "calibration file" in capsys.readouterr().err


# -- perplexity ----------------------------------------------------------------------------------
class FixedLogits:
    """An executable whose logits put probability p on the token that follows, spread the rest."""

    def __init__(self, windows: torch.Tensor, vocab: int, p: float):
        self.windows, self.vocab, self.p = windows, vocab, p
        self.options = BackendOptions(max_seq_len=windows.shape[1])

    def reset(self):
        pass

    def run(self, tokens, positions):
        following = torch.roll(tokens[0], -1)
        probs = torch.full((tokens.shape[1], self.vocab), (1 - self.p) / (self.vocab - 1))
        probs[torch.arange(tokens.shape[1]), following] = self.p
        return probs.log()[None]


def test_perplexity_is_the_inverse_probability_of_the_next_token():
    windows = token_windows(list(range(50)) * 4, length=20, count=3)
    assert windows.shape == (3, 20) and windows[1, 0] == 20
    result = perplexity(FixedLogits(windows, vocab=50, p=0.25), windows)
    assert result.tokens == 3 * 19 and math.isclose(result.perplexity, 4.0, rel_tol=1e-6)
    assert all(math.isclose(p, 4.0, rel_tol=1e-6) for p in result.per_window)
    uniform = window_nll(torch.zeros(20, 50), windows[0])
    assert torch.allclose(uniform, torch.full((19,), math.log(50), dtype=torch.float64))


def test_perplexity_token_by_token_through_the_cache_equals_one_prefill(tiny_llama_captured):
    from kiln.backends import reference
    from kiln.passes.pipeline import run_pipeline

    options = BackendOptions(max_seq_len=MAX_SEQ, quantize="int4-g32")
    executable = reference.lower(run_pipeline(copy_graph(tiny_llama_captured), options), options)
    windows = torch.randint(3, 500, (1, 16))
    whole, stepwise = perplexity(executable, windows), perplexity(executable, windows, chunk=1)
    assert math.isclose(whole.perplexity, stepwise.perplexity, rel_tol=1e-4)


# -- the real model ------------------------------------------------------------------------------
@pytest.mark.slow
def test_int8_perplexity_of_smollm2_on_moby_dick_is_within_one_percent_of_fp32(smollm2_dir):
    from kiln.backends import reference
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.moby_dick import DatasetError, evaluation_text
    from kiln.passes.pipeline import run_pipeline
    from kiln.runtime.tokenizer import Tokenizer

    try:
        text = evaluation_text()
    except DatasetError as error:
        pytest.skip(f"Moby-Dick is not available: {error}")
    windows = token_windows(Tokenizer.from_dir(smollm2_dir).encode(text, add_special_tokens=False), 512, 2)
    captured = capture_causal_lm(load_model(smollm2_dir).model, max_batch=1, max_seq_len=512)
    results = {}
    for scheme in (None, "int8"):
        options = BackendOptions(max_seq_len=512, quantize=scheme)
        results[scheme] = perplexity(reference.lower(run_pipeline(copy_graph(captured), options), options), windows)
    assert results["int8"].perplexity < 1.01 * results[None].perplexity, results
