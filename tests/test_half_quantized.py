"""Quantized weights in half-precision graphs (`dtype="bf16"` / `"f16"` with `quantize`): the
options that allow them (inductor on CUDA) and refuse them, `linear_q` and `embedding_q` computing
in the graph's dtype, and a tiny Llama captured in bf16 and quantized, run by the interpreter
against the same model in f32."""

from __future__ import annotations

import functools

import pytest
import torch

from kiln.backends.executable import BackendOptions
from kiln.compile_options import CompileOptions, kv_cache_bytes
from kiln.ir import OpError, TensorType, get_op, parse_graph, print_graph, run_graph, to_torch
from kiln.ir.errors import OptionError
from kiln.ir.ops.quantized import dequantize
from kiln.passes.round_to_nearest import quantize_weight
from tiny_models import save_tiny_checkpoint

MAX_SEQ, LENGTH = 16, 12
QUANTIZED_WEIGHT_PARTS = (".q8", ".q4", ".scales", ".zeros")


def options(tmp_path, **given) -> CompileOptions:
    return CompileOptions.checked(model=None, out=tmp_path / "m.kiln", **given)


# -- which targets take which dtype and quantization ----------------------------------------------
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_inductor_targets_cuda_in_every_compute_dtype(tmp_path, dtype, device):
    checked = options(tmp_path, backend="inductor", device=device, dtype=dtype)
    assert checked.torch_dtype == to_torch(dtype) and checked.backend_options().dtype == dtype


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("quantize", ["int8", "int4-g32", "int4-g64-asym", "int8-g32", "int4-g32-fit"])
def test_inductor_on_cuda_quantizes_half_precision_graphs(tmp_path, dtype, quantize):
    checked = options(tmp_path, device="cuda", dtype=dtype, quantize=quantize, quantize_embeddings=True)
    assert checked.backend_options().quantize == quantize


@pytest.mark.parametrize(
    "given, message",
    [
        (
            {"backend": "tinygrad", "device": "cuda", "dtype": "f16", "quantize": "int8"},
            r"quantize='int8' with dtype 'f16' is not supported yet by the tinygrad backend.*Fix:",
        ),
        ({"backend": "reference", "device": "cuda:0"}, r"the reference backend runs on the CPU only"),
        ({"dtype": "bf16"}, r"dtype 'bf16' is for GPUs.*device='cpu'.*Fix: dtype='f32'"),
        ({"dtype": "f16", "backend": "onnxruntime"}, r"dtype 'f16' is for GPUs.*Fix: dtype='f32'"),
        ({"dtype": "bf16", "backend": "onnxruntime", "device": "cuda"}, r"bf16 only in part.*Fix: dtype='f16'"),
        (
            {"dtype": "f16", "backend": "onnxruntime", "device": "cuda", "quantize": "int8"},
            r"quantize='int8' with dtype 'f16' is not supported yet by the onnxruntime backend.*Fix:",
        ),
        (
            {"dtype": "bf16", "device": "cuda", "quantize": "int4-g32-awq"},
            r"quantize='int4-g32-awq' measures activations.*not dtype 'bf16'.*Fix:",
        ),
        ({"dtype": "f16", "device": "cuda", "quantize": "int4-mixed"}, r"int4-mixed' measures activations"),
        ({"dtype": "bf16", "device": "cuda", "quantize": "int4-g32-fit-imatrix"}, r"measures activations"),
        ({"dtype": "bf16", "device": "cuda", "kv_cache": "int8"}, r"kv_cache='int8' quantizes f32"),
    ],
)
def test_targets_that_cannot_run_a_dtype_are_refused_naming_the_fix(tmp_path, given, message):
    with pytest.raises(OptionError, match=message):
        options(tmp_path, **given)


def test_onnxruntime_on_cuda_keeps_f16_without_quantize(tmp_path):
    assert options(tmp_path, backend="onnxruntime", device="cuda", dtype="f16").dtype == "f16"


def test_a_bf16_kv_cache_is_sized_at_two_bytes_a_number(tmp_path):
    class Config:
        num_hidden_layers, num_attention_heads, hidden_size, num_key_value_heads = 2, 4, 64, 2

    sizes = {
        d: kv_cache_bytes(Config, options(tmp_path, device="cuda", dtype=d, max_seq_len=8)) for d in ("f32", "bf16")
    }
    rope = 16 * 4 * 8  # the rope tables stay f32
    assert sizes["bf16"] - rope == (sizes["f32"] - rope) // 2 == 2 * 2 * 2 * 16 * 8 * 2


# -- the ops, in the graph's dtype ------------------------------------------------------------------
def quantized_table(rows=8, cols=64, bits=4, group_size=32, symmetric=False):
    torch.manual_seed(0)
    return quantize_weight(torch.randn(rows, cols), bits, group_size, symmetric)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_linear_q_computes_in_its_inputs_dtype_with_the_f32_dequantized_weight_cast_to_it(dtype):
    q = quantized_table()
    x = torch.randn(2, 3, 64).to(to_torch(dtype))
    bias = torch.randn(8).to(to_torch(dtype))
    op, types = get_op("linear_q"), [TensorType(dtype, (2, 3, 64)), TensorType("u8", (8, 32))]
    out_type = op.infer(*types, TensorType("f32", (8, 2)), TensorType("u8", (8, 2)), TensorType(dtype, (8,)), 4, 32)
    assert out_type == TensorType(dtype, (2, 3, 8))
    out = op.reference(x, q.qweight, q.scales, q.zeros, bias, 4, 32)
    weight = dequantize(q.qweight, q.scales, q.zeros, 4, 32)
    assert out.dtype == x.dtype and torch.equal(out, torch.nn.functional.linear(x, weight.to(x.dtype), bias))


def test_linear_q_refuses_a_bias_of_another_dtype_than_its_input():
    types = [TensorType("bf16", (3, 64)), TensorType("u8", (8, 32)), TensorType("f32", (8, 2)), None]
    with pytest.raises(OpError, match=r"bias f32\[8\] must be bf16\[8\]"):
        get_op("linear_q").infer(*types, TensorType("f32", (8,)), 4, 32)
    with pytest.raises(OpError, match="must be f32, f16 or bf16"):
        get_op("linear_q").infer(TensorType("i32", (3, 64)), *types[1:], None, 4, 32)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_embedding_q_gives_rows_in_its_dtype_attribute(dtype):
    q, ids = quantized_table(), torch.tensor([[3, 0, 7]])
    op = get_op("embedding_q")
    out_type = op.infer(
        TensorType("u8", (8, 32)), TensorType("f32", (8, 2)), TensorType("i64", (1, 3)), None, 4, 32, dtype
    )
    assert out_type == TensorType(dtype, (1, 3, 64))
    rows = op.reference(q.qweight, q.scales, ids, q.zeros, 4, 32, dtype)
    assert rows.dtype == to_torch(dtype) and torch.equal(rows, q.dequantize()[ids].to(to_torch(dtype)))
    with pytest.raises(OpError, match="embedding_q: dtype must be one of"):
        op.infer(TensorType("u8", (8, 32)), TensorType("f32", (8, 2)), TensorType("i64", (1, 3)), None, 4, 32, "i8")


# -- a tiny Llama captured in bf16, quantized, run by the interpreter -------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # Weights of a trained model's size (0.02, not tests/tiny_models.py's 0.2, whose logits spread so
    # wide that bf16 activations alone move them by 1.5%).
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), initializer_range=0.02)


@functools.cache
def quantized_graph(model_dir, dtype: str, quantize: str, embeddings: bool):
    """The stateful graph of the tiny Llama with its weights rounded to bf16 (so both dtypes quantize
    the same numbers), captured in `dtype` and run through the pass pipeline."""
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.passes.pipeline import run_pipeline

    model = load_model(model_dir).model.to(torch.bfloat16).float()
    graph = capture_causal_lm(model, max_batch=1, max_seq_len=MAX_SEQ, dtype=to_torch(dtype))
    given = BackendOptions(max_seq_len=MAX_SEQ, dtype=dtype, quantize=quantize, quantize_embeddings=embeddings)
    return run_pipeline(graph, given)


def logits(graph, weights=None) -> torch.Tensor:
    torch.manual_seed(1)
    feeds = {"tokens": torch.randint(3, 512, (1, LENGTH)), "positions": torch.arange(LENGTH)[None]}
    for cache in graph.inputs[2:]:  # the empty KV cache
        feeds[cache.name] = torch.zeros(cache.type.shape, dtype=to_torch(cache.type.dtype))
    return run_graph(graph, feeds, weights)[0]


def ops_count(graph, op: str) -> int:
    return sum(n.op == op for n in graph.nodes)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.mark.parametrize("quantize, embeddings", [("int8", True), ("int4-g32", False)])
def test_a_bf16_llama_quantizes_like_f32_and_computes_close_to_it(llama_dir, quantize, embeddings):
    half, full = (quantized_graph(llama_dir, dtype, quantize, embeddings) for dtype in ("bf16", "f32"))
    ops = [n.op for n in half.nodes]
    assert ops.count("linear_q") == ops_count(full, "linear_q") == 4 * 2 + embeddings  # 4 a layer, lm_head
    assert ("embedding_q" in ops) == embeddings and ("linear" in ops) == (not embeddings)  # the lm_head
    assert all(n.output.type.dtype == "bf16" for n in half.nodes if n.op in ("linear_q", "embedding_q"))
    if embeddings:
        assert next(n for n in half.nodes if n.op == "embedding_q").attrs["dtype"] == "bf16"
    parts = [name for name in full.weights if name.endswith(QUANTIZED_WEIGHT_PARTS)]
    assert parts and all(torch.equal(half.weights[name], full.weights[name]) for name in parts)
    assert all(half.weights[name].dtype == torch.float32 for name in parts if name.endswith(".scales"))
    got, want = logits(half), logits(full)
    assert got.shape == want.shape and relative_error(got, want) < 2e-2
    assert half.meta["quantization"]["weight_bytes_before"] * 2 == full.meta["quantization"]["weight_bytes_before"]


def test_an_f16_llama_quantizes_too(llama_dir):
    half, full = (quantized_graph(llama_dir, dtype, "int4-g32", True) for dtype in ("f16", "f32"))
    assert next(n for n in half.nodes if n.op == "embedding_q").attrs["dtype"] == "f16"
    assert relative_error(logits(half), logits(full)) < 1e-2


def test_the_quantized_bf16_graph_survives_the_artifact(llama_dir, tmp_path):
    """Printed, saved with its weights, read back and parsed: the same graph, the same logits."""
    from kiln.runtime.artifact import read_artifact, save_artifact

    graph = quantized_graph(llama_dir, "bf16", "int8", True)
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)
    assert 'dtype="bf16"' in next(line for line in print_graph(graph).splitlines() if "embedding_q(" in line)

    class NoCode:
        def save(self, directory):
            return []

    fields = {"backend": "reference", "options": {}}
    read = read_artifact(save_artifact(tmp_path / "m.kiln", graph, NoCode(), manifest_fields=fields)).graph
    assert print_graph(read) == print_graph(graph)
    assert {name: t.dtype for name, t in read.weights.items()} == {name: t.dtype for name, t in graph.weights.items()}
    assert torch.equal(logits(read), logits(graph))


def test_f32_embedding_q_defaults_to_f32_rows(llama_dir):
    graph = quantized_graph(llama_dir, "f32", "int8", True)
    node = next(n for n in graph.nodes if n.op == "embedding_q")
    assert node.attrs["dtype"] == "f32" and node.output.type.dtype == "f32"
