"""Kiln's Triton GEMV for the CUDA decode step (backends/inductor/cuda_gemv.py, its kernel in
cuda_gemv_kernel.py) and the rewrite that uses it (cuda_decode_fusion.use_triton_gemv).

Without a GPU the kernel runs in Triton's interpreter (tests/triton_mode.py) at fixed block
sizes (the autotuner needs a GPU); on one, the autotuned kernel too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_oracle import hf_greedy, prompts
from kiln.backends.inductor.cuda_decode_fusion import fuse_decode_attention, use_triton_gemv
from kiln.backends.inductor.cuda_gemv import launch_gemv
from kiln.frontend.checkpoint import load_model
from test_cuda_decode_attention import decode_module_for, step
from tiny_models import ARCHITECTURES, EOS_TOKEN_ID

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [  # rows, outputs, inputs, bias, (BLOCK_N, BLOCK_K, warps)
    (1, 40, 70, True, (8, 32, 4)),  # K and N not multiples of the blocks
    (3, 64, 576, False, (16, 128, 4)),
    (4, 33, 1000, True, (4, 256, 2)),
    (2, 7, 5, False, (2, 128, 2)),  # K under one block
]
# f32 to its summation order; half: the output's rounding (the interpreter's bf16 conversion truncates)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_computes_the_product(case, dtype):
    rows, n, k, with_bias, block = case
    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, 1, k, generator=generator).to(dtype).to(DEVICE)
    weight = torch.randn(n, k, generator=generator).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=generator).to(dtype).to(DEVICE) if with_bias else None
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = launch_gemv(x, weight, bias=bias, block=block)
    assert got.shape == (rows, 1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * k**0.5, rtol=TOLERANCE[dtype])


QUANTIZED_CASES = [  # rows, outputs, inputs, group, asymmetric (int4), (BLOCK_N, BLOCK_K, warps)
    (1, 40, 96, 32, False, (8, 64, 4)),
    (3, 24, 256, 64, True, (4, 128, 4)),
    (2, 17, 100, 24, True, (2, 128, 2)),  # a group that divides neither K nor the block
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", QUANTIZED_CASES)
def test_the_int4_kernel_computes_linear_q(case, dtype):
    from kiln.backends.inductor.cuda_gemv import launch_gemv_int4
    from kiln.ir.ops.quantized import linear_q_reference
    from test_cuda_inductor import random_int4_weight

    rows, n, k, group, asymmetric, block = case
    qweight, scales, zeros = random_int4_weight(n, k - k % group + group * (k % group > 0), group, asymmetric, 7)
    qweight = qweight[:, : k // 2].contiguous()  # K columns: the last group may be shorter
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    bias = torch.randn(n).to(dtype)
    parts = [t if t is None else t.to(DEVICE) for t in (x, qweight, scales, zeros, bias)]
    expected = linear_q_reference(
        *[t if t is None else t.float() if t.is_floating_point() else t for t in parts], 4, group
    )
    got = launch_gemv_int4(*parts, group, block=block)
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * k**0.5, rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_kernel_scales_each_output(dtype):
    from kiln.backends.inductor.cuda_lowerings import linear_int8_channels

    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (24, 200), dtype=torch.int8, generator=generator).to(DEVICE)
    scales = (torch.rand(24, generator=generator) * 0.01).to(DEVICE)
    x = torch.randn(2, 200, generator=generator).to(dtype).to(DEVICE)
    expected = linear_int8_channels(x.float(), codes, scales, None)
    got = launch_gemv(x, codes, scales, block=(8, 64, 4))
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * 15, rtol=TOLERANCE[dtype])


def test_more_rows_than_the_kernel_holds_are_refused_by_the_launcher():
    with pytest.raises(ValueError, match="at most 4 rows"):
        launch_gemv(torch.randn(5, 8), torch.randn(4, 8), block=(4, 128, 2))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_product_rewritten_gives_hugging_faces_greedy_tokens(tiny_model_dirs, arch):
    """Both rewrites on the decode module (the op runs F.linear off the GPU)."""
    model = load_model(tiny_model_dirs(arch)).model
    prefill, decode, _, graph = decode_module_for(model)
    rewritten = use_triton_gemv(decode)
    assert rewritten == sum(n.op == "linear" for n in graph.nodes)
    prompt = prompts([9])[0]
    expected = hf_greedy(model, prompt, 10, {EOS_TOKEN_ID})
    got = [int(step(prefill, prompt, 0)[0, -1].argmax())]
    while len(got) < 10 and got[-1] != EOS_TOKEN_ID:
        got.append(int(step(decode, got[-1:], len(prompt) + len(got) - 1)[0, -1].argmax()))
    assert got == expected


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int4-g32-asym"])
def test_quantized_products_rewritten_decode_as_before(tiny_model_dirs, scheme):
    """A quantized model's decode module with its products through the GEMV ops gives the
    unfused module's greedy tokens (off the GPU the ops run the CUDA lowering's own forms)."""
    import copy

    import torch.fx as fx

    from kiln.backends.executable import BackendOptions
    from kiln.backends.inductor import graph_to_fx
    from kiln.backends.inductor.executable import allocate_caches
    from kiln.frontend.capture import capture_causal_lm
    from kiln.passes.pipeline import run_pipeline

    model = load_model(tiny_model_dirs("llama")).model
    options = BackendOptions(max_batch=1, max_seq_len=64, quantize=scheme)
    graph = run_pipeline(capture_causal_lm(model, 1, 64), options)
    module = graph_to_fx(graph, state=allocate_caches(graph), lowering_for="cuda")
    unfused = fx.GraphModule(module, copy.deepcopy(module.graph))
    decode = fx.GraphModule(module, copy.deepcopy(module.graph))
    unfused.input_names = decode.input_names = module.input_names
    assert use_triton_gemv(decode) == sum(n.op in ("linear", "linear_q") for n in graph.nodes)
    prompt = prompts([9])[0]
    runs = []
    for stepper in (unfused, decode):
        for buffer in module.buffers():
            buffer.zero_()
        tokens = [int(step(module, prompt, 0)[0, -1].argmax())]
        while len(tokens) < 10:
            tokens.append(int(step(stepper, tokens[-1:], len(prompt) + len(tokens) - 1)[0, -1].argmax()))
        runs.append(tokens)
    assert runs[0] == runs[1]


def test_quantized_and_computed_weights_keep_their_own_forms():
    import torch.fx as fx

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("weight", torch.randn(4, 8))
            self.register_buffer("codes", torch.randint(-8, 8, (4, 8), dtype=torch.int8))

        def forward(self, x):  # traced, not run: int8 codes are the quantized lowerings' to read
            return F.linear(x, self.weight) + F.linear(x, self.codes) + F.linear(x, x[:4] * 2)

    module = fx.symbolic_trace(Model())
    assert use_triton_gemv(module) == 1
    assert fuse_decode_attention(module) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the autotuner runs on one)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_autotuned_kernel_on_the_gpu(dtype):
    x = torch.randn(2, 2048, device="cuda", dtype=dtype)
    weight = torch.randn(2048 * 3, 2048, device="cuda", dtype=dtype)
    got = launch_gemv(x, weight)
    expected = F.linear(x.float(), weight.float())
    assert ((got.float() - expected).norm() / expected.norm()) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_run.sh runs it on one)")
@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int4-g32-asym"])
def test_quantized_decode_through_the_gemv_on_the_gpu(monkeypatch, scheme):
    from kiln.backends.executable import BackendOptions
    from kiln.backends.inductor import lower
    from kiln.passes.quant_schemes import SCHEMES
    from kiln.passes.quantize_weights import quantize_weights
    from test_inductor_backend import PREFILL, InterpreterOracle, build_toy_transformer, decode_feeds

    monkeypatch.setenv("KILN_CUDA_DECODE_LINEAR", "triton")
    torch.backends.cuda.matmul.allow_tf32 = False
    graph = build_toy_transformer()
    quantize_weights(graph, SCHEMES[scheme])
    executable = lower(graph, BackendOptions(max_batch=2, max_seq_len=32, device="cuda"))
    oracle = InterpreterOracle(graph)
    for feeds in [PREFILL] + [decode_feeds(i) for i in range(4)]:
        torch.testing.assert_close(executable.run(*feeds), oracle.run(*feeds), atol=1e-3, rtol=1e-3)
    assert "gemv" in executable._decode._orig_mod.code


@pytest.mark.parametrize(
    "variable, read",
    [
        ("KILN_CUDA_DECODE_LINEAR", "kiln.backends.inductor.cuda_gemv:decode_linear_form"),
        ("KILN_CUDA_DECODE_ATTENTION", "kiln.backends.inductor.cuda_lowerings:decode_attention_form"),
        ("KILN_CUDA_DECODE_TUNING", "kiln.backends.inductor.cuda_executable:decode_tuning"),
    ],
)
def test_a_decode_switch_set_to_no_choice_says_which_are(monkeypatch, variable, read):
    import importlib

    from kiln.ir.errors import OptionError

    module, name = read.split(":")
    monkeypatch.setenv(variable, "fastest")
    with pytest.raises(OptionError, match=f"{variable}='fastest' is not a choice. Fix:"):
        getattr(importlib.import_module(module), name)()
