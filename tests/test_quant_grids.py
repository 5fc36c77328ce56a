"""Grids beyond round-to-nearest with f32 scales: int8 in groups of 32 with f16 scales (int8-g32),
fitted 4-bit rounding with fractional zero points (int4-gN-fit) and its mixed scheme
(int4-fit-mixed), from the rounding of one weight to the KLD of the tiny seeded llama."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kiln.backends.executable import BackendOptions
from kiln.ir.registry import OpError
from kiln.passes.fitted_rounding import fit_weight
from kiln.passes.quant_schemes import get_scheme
from kiln.passes.round_to_nearest import quantize_weight
from kiln.runtime.quality import compare_executables
from tiny_models import TRAINING_TEXT

LENGTH = 64


def relative_error(q, w):
    return float((q.dequantize() - w).norm() / w.norm())


def test_int8_in_groups_of_32_stores_f16_scales_and_rounds_finer_than_per_channel():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    w[:, 5] *= 20  # one large input column: a per-channel scale pays for it in every row
    grouped = quantize_weight(w, 8, 32, True, scale_dtype="f16")
    assert grouped.scales.dtype == torch.float16 and grouped.scales.shape == (48, 3)
    assert grouped.nbytes * 8 / w.numel() == 8.5  # llama.cpp's Q8_0: 8 bits + an f16 per 32
    per_channel = quantize_weight(w, 8, 96, True)
    elsewhere = lambda q: float((q.dequantize() - w)[:, 32:].norm())  # noqa: E731 (the groups without it)
    assert elsewhere(grouped) < 0.2 * elsewhere(per_channel)
    # the codes are rounded against the stored f16 scale: dequantizing is within half a step
    step = grouped.scales.float().repeat_interleave(32, dim=1)
    assert ((grouped.dequantize() - w).abs() <= 0.5 * step + 1e-6).all()


def test_fitted_rounding_beats_round_to_nearest_and_keeps_a_weight_on_its_grid():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    fitted = fit_weight(w, 32)
    assert fitted.zeros.dtype == torch.float16 and fitted.scales.dtype == torch.float16
    assert fitted.nbytes * 8 / w.numel() == 5.0  # 4 bits + an f16 scale and zero point per 32
    nearest = quantize_weight(w, 4, 32, False, scale_dtype="f16", float_zero=True)
    symmetric = quantize_weight(w, 4, 32, True)
    assert relative_error(fitted, w) < 0.95 * relative_error(nearest, w) < relative_error(symmetric, w)
    # A weight already on a 4-bit grid with a free offset per group (llama.cpp's Q4_1) keeps it.
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (64, 4, 32), generator=gen).float()
    codes[..., :2] = torch.tensor([0.0, 15.0])
    scale = (torch.rand(64, 4, 1, generator=gen) * 0.1 + 0.01).half().float()
    offset = -(torch.rand(64, 4, 1, generator=gen)).half().float()
    on_grid = (codes * scale + offset).reshape(64, 128)
    assert relative_error(fit_weight(on_grid, 32), on_grid) < 1e-3 < relative_error(symmetric, w)


def test_importance_moves_the_error_to_the_columns_that_matter_less():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    importance = torch.ones(64)
    importance[:8] = 100.0
    plain, weighted = fit_weight(w, 32), fit_weight(w, 32, importance)
    error = lambda q: (q.dequantize() - w)[:, :8].pow(2).sum()  # noqa: E731
    assert error(weighted) < error(plain)
    with pytest.raises(ValueError, match="importance has 10 columns"):
        fit_weight(w, 32, torch.ones(10))


def test_quantized_ops_check_the_scale_and_zero_point_dtypes():
    from kiln.ir import TensorType
    from kiln.ir.registry import get_op

    infer = get_op("linear_q").infer
    x, q4 = TensorType("f32", (1, 64)), TensorType("u8", (8, 32))
    assert infer(x, q4, TensorType("f16", (8, 2)), TensorType("f16", (8, 2)), None, 4, 32).shape == (1, 8)
    assert infer(x, q4, TensorType("f32", (8, 2)), TensorType("u8", (8, 2)), None, 4, 32).shape == (1, 8)
    with pytest.raises(OpError, match="zeros must be u8 .* or f16"):
        infer(x, q4, TensorType("f16", (8, 2)), TensorType("f32", (8, 2)), None, 4, 32)
    with pytest.raises(OpError, match="scales must be f32 or f16"):
        infer(x, q4, TensorType("i32", (8, 2)), None, None, 4, 32)
    embedding = get_op("embedding_q").infer(q4, TensorType("f16", (8, 2)), TensorType("i64", (1, 3)), None, 4, 32)
    assert embedding.dtype == "f32"


# -- the tiny seeded llama ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs):
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.runtime.tokenizer import Tokenizer

    directory = tiny_model_dirs("llama")
    ids = Tokenizer.from_dir(directory).encode(TRAINING_TEXT * 3, add_special_tokens=False)
    windows = torch.tensor(ids[: 4 * LENGTH]).view(4, LENGTH)
    return capture_causal_lm(load_model(directory).model, max_batch=1, max_seq_len=LENGTH), windows


def copy_graph(graph):
    from kiln.ir import parse_graph, print_graph

    copy = parse_graph(print_graph(graph))
    copy.weights = dict(graph.weights)
    return copy


def pipeline(captured, windows, quantize=None, embeddings=False):
    from kiln.passes.pipeline import run_pipeline

    options = BackendOptions(max_seq_len=LENGTH, quantize=quantize, quantize_embeddings=embeddings)
    return run_pipeline(copy_graph(captured), options, calibration=windows[:2]), options


def compiled(captured, windows, quantize=None, embeddings=False, backend="reference"):
    from kiln.backends.registry import get_backend

    graph, options = pipeline(captured, windows, quantize, embeddings)
    return get_backend(backend).lower(graph, options)


@pytest.fixture(scope="module")
def f32(tiny_llama):
    return compiled(*tiny_llama)


# Measured on this seeded model through the interpreter, lm_head quantized too: int8-g32 0.0022,
# int4-g32-fit 0.326 (round-to-nearest int4-g32: 0.41), int4-g32-fit-imatrix 0.303. Its random
# weights are far harder on 4 bits than a trained model's; a pass that rounds worse moves these
# by more than the margin.
KLD_BUDGET = {"int8-g32": 0.004, "int4-g32-fit": 0.37, "int4-g32-fit-imatrix": 0.34}


@pytest.mark.parametrize("scheme", sorted(KLD_BUDGET))
def test_the_new_grids_keep_their_kld_budgets(tiny_llama, f32, scheme):
    result = compare_executables(compiled(*tiny_llama, scheme, embeddings=True), f32, tiny_llama[1])
    assert 0 < result.mean_kld < KLD_BUDGET[scheme], result.summary()


def test_activation_importance_lowers_the_fitted_kld(tiny_llama, f32):
    captured, windows = tiny_llama
    plain, weighted = (
        compare_executables(compiled(captured, windows, scheme, embeddings=True), f32, windows).mean_kld
        for scheme in ("int4-g32-fit", "int4-g32-fit-imatrix")
    )
    assert weighted < 0.97 * plain


@pytest.fixture(scope="module")
def fused(tiny_llama):
    """The tiny llama through canonicalize + fuse: what the quantize phase sees."""
    from kiln.passes.pipeline import default_pipeline

    manager = default_pipeline(BackendOptions(max_seq_len=LENGTH))
    manager.phases = [p for p in manager.phases if p[0] in ("canonicalize", "fuse")]
    return manager.run(copy_graph(tiny_llama[0]))


def test_importance_is_the_mean_square_of_each_linears_input(fused, tiny_llama):
    from kiln.passes.activation_importance import activation_importance
    from kiln.passes.activation_taps import collect_activation_stats

    scheme = get_scheme("int4-g32-fit-imatrix")
    importance = activation_importance(fused, scheme, tiny_llama[1][:1])
    linears = {n.inputs[1].name: n for n in fused.nodes if n.op == "linear"}
    assert importance and set(importance) <= set(linears)
    assert "lm_head.weight" not in importance  # the output projection stays f32 without --quantize-embeddings
    name, values = next(iter(importance.items()))
    x = linears[name].inputs[0]
    stats = collect_activation_stats(fused, tiny_llama[1][:1], [x], rows_per_sequence=LENGTH)[x.name]
    assert values.shape == (x.type.shape[-1],) and torch.allclose(values, stats.rows().pow(2).mean(0), rtol=1e-4)


def test_the_fitted_mixed_scheme_buys_int8_g32_for_the_most_sensitive_tensors(fused, tiny_llama, f32):
    """Measured: the sensitivities 0.18 (layer 0), 0.11 (lm_head), 0.015 (layer 1); 6.5 bits buy
    layer 0 (KLD 0.15 against int4-g32-fit's 0.33), 5 bits nothing."""
    from kiln.backends import reference
    from kiln.passes.mixed_precision import quantize_mixed
    from kiln.passes.pipeline import kv_cache_insertion

    windows = tiny_llama[1]
    scheme = replace(get_scheme("int4-fit-mixed"), budget_bits=6.5)
    mixed = quantize_mixed(copy_graph(fused), scheme, windows[:1], include_embeddings=True)
    meta = mixed.meta["quantization"]
    sensitivity = meta["sensitivity"]
    assert meta["upgrade"] == "int8-g32" and meta["int8_layers"] == [max(sensitivity, key=sensitivity.get)]
    assert meta["weight_bytes_after"] * 8 <= 6.5 * meta["weight_bytes_before"] / 4  # f32 bytes / 4 = weights
    linears = [n for n in mixed.nodes if n.op == "linear_q"]
    assert {n.attrs["bits"] for n in linears} == {4, 8}
    assert all(n.inputs[3].type.dtype == "f16" for n in linears if n.attrs["bits"] == 4)  # fractional zeros
    options = BackendOptions(max_seq_len=LENGTH)
    result = compare_executables(reference.lower(kv_cache_insertion(options).run(mixed), options), f32, windows)
    assert result.mean_kld < 0.25, result.summary()
    tight = quantize_mixed(copy_graph(fused), replace(scheme, budget_bits=5.0), windows[:1], include_embeddings=True)
    assert tight.meta["quantization"]["int8_layers"] == []  # int4-g32-fit alone is 5 bits


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "inductor", "tinygrad"])
def test_backends_run_f16_scales_and_fractional_zero_points_like_the_interpreter(tiny_llama, backend):
    """int8-g32 and int4-g32-fit graphs lowered by each backend stay within 0.005 of the
    interpreter (ONNX Runtime and Inductor round activations to int8 in some kernels)."""
    captured, windows = tiny_llama
    for scheme in ("int8-g32", "int4-g32-fit"):
        interpreted = compiled(captured, windows, scheme, embeddings=True)
        lowered = compiled(captured, windows, scheme, embeddings=True, backend=backend)
        assert compare_executables(lowered, interpreted, windows).mean_kld < 0.005, (backend, scheme)
