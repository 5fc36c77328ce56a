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
    got = launch_gemv(x, weight, bias, block=block)
    assert got.shape == (rows, 1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype] * k**0.5, rtol=TOLERANCE[dtype])


def test_more_rows_than_the_kernel_holds_are_refused_by_the_launcher():
    with pytest.raises(ValueError, match="at most 4 rows"):
        launch_gemv(torch.randn(5, 8), torch.randn(4, 8), None, block=(4, 128, 2))


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
    got = launch_gemv(x, weight, None)
    expected = F.linear(x.float(), weight.float())
    assert ((got.float() - expected).norm() / expected.norm()) < 1e-2
