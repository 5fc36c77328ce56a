"""The Inductor backend's CUDA path (backends/inductor/cuda_executable.py, cuda_lowerings.py).

What a machine without a GPU can check runs everywhere: the CUDA lowering emits torch ops only
(no Kiln CPU kernel) and computes what the interpreter does, the last-position lm_head, tinygemm's
rewriting of Kiln's int4 groups, and the clear refusals. Tests marked `gpu` need a CUDA device
and are skipped without one (CI has none; bench/gpu.py runs them on a GPU machine).
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_greedy, prompts
from kiln.backends.executable import BackendOptions
from kiln.backends.inductor import graph_to_fx, lower
from kiln.backends.inductor.cuda_executable import CompiledWhereLoaded, last_position_module
from kiln.backends.inductor.cuda_lowerings import dequantized_tinygemm_weight, linear_int8_channels
from kiln.backends.inductor.executable import allocate_caches
from kiln.backends.token_trees import tree_feeds
from kiln.frontend.capture import capture_causal_lm
from kiln.frontend.checkpoint import load_model
from kiln.ir.errors import OptionError
from kiln.ir.ops.quantized import dequantize, pack_int4
from kiln.passes.pipeline import run_pipeline
from kiln.passes.quant_schemes import SCHEMES
from kiln.passes.quantize_weights import quantize_weights
from test_inductor_backend import PREFILL, InterpreterOracle, build_toy_transformer, decode_feeds
from tiny_models import ARCHITECTURES, EOS_TOKEN_ID, FAMILIES

MAX_BATCH, MAX_SEQ = 2, 32
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here; bench/gpu.py runs these on one)")


def lowered_for_cuda(graph):
    """The graph lowered as for a GPU, run here on the CPU with caches of its own."""
    return graph_to_fx(graph, state=allocate_caches(graph), lowering_for="cuda")


def kiln_kernel_calls(module) -> list[str]:
    return [str(n.target) for n in module.graph.nodes if "kiln." in str(n.target)]


def test_the_cuda_lowering_emits_no_cpu_kernel_and_matches_the_interpreter():
    graph = build_toy_transformer()
    module = lowered_for_cuda(graph)
    assert kiln_kernel_calls(module) == []
    oracle = InterpreterOracle(graph)
    for feeds in [PREFILL, decode_feeds(0), decode_feeds(1)]:
        torch.testing.assert_close(module(*feeds)[0], oracle.run(*feeds), atol=1e-4, rtol=1e-4)


def step(module, tokens: list[int], start: int) -> torch.Tensor:
    """One call of a lowered stateful module over `tokens` at positions from `start`."""
    ids, positions = torch.tensor([tokens]), torch.arange(start, start + len(tokens))[None]
    extra = tree_feeds(positions, None, None) if "slots" in module.input_names else ()
    with torch.no_grad():
        return module(ids, positions, *extra)[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", ARCHITECTURES + FAMILIES)
def test_the_cuda_lowering_gives_hugging_faces_greedy_tokens(tiny_model_dirs, family):
    """Every architecture and family through the lowerings a GPU gets (composite attention where
    ALiBi or soft-capping needs it, experts gathered), run here on the CPU."""
    model = load_model(tiny_model_dirs(family)).model
    options = BackendOptions(max_batch=1, max_seq_len=64)
    graph = run_pipeline(capture_causal_lm(model, options.max_batch, options.max_seq_len), options)
    module = lowered_for_cuda(graph)
    assert kiln_kernel_calls(module) == []
    prompt = prompts([9])[0]
    expected = hf_greedy(model, prompt, 16, {EOS_TOKEN_ID})
    got, tokens, start = [], prompt, 0
    while len(got) < 16 and (not got or got[-1] != EOS_TOKEN_ID):
        got.append(int(step(module, tokens, start)[0, -1].argmax()))
        start, tokens = start + len(tokens), got[-1:]
    assert got == expected


def test_int8_channels_lower_to_the_fused_form_and_match_the_interpreter():
    graph = build_toy_transformer()
    quantize_weights(graph, SCHEMES["int8"])
    module = lowered_for_cuda(graph)
    assert kiln_kernel_calls(module) == []
    assert any(n.target is linear_int8_channels for n in module.graph.nodes)
    oracle = InterpreterOracle(graph)
    torch.testing.assert_close(module(*PREFILL)[0], oracle.run(*PREFILL), atol=1e-4, rtol=1e-4)


def test_the_last_position_module_gives_the_last_logits_alone():
    graph = build_toy_transformer()
    full, last = lowered_for_cuda(graph), lowered_for_cuda(graph)
    last = last_position_module(last)
    assert last is not None
    every = full(*PREFILL)[0]
    torch.testing.assert_close(last(*PREFILL)[0], every[:, -1:], atol=1e-5, rtol=1e-5)


def random_int4_weight(n: int, k: int, group: int, asymmetric: bool, seed: int):
    """(packed codes, scales, zero points or None) of a random 4-bit [n, k] weight."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    scales = torch.rand(n, k // group, generator=generator) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=generator) if asymmetric else None
    return pack_int4(codes), scales, zeros


@pytest.mark.parametrize("asymmetric", [False, True])
def test_tinygemm_groups_stand_for_kilns_within_bf16_rounding(asymmetric):
    group = 32
    qweight, scales, zeros = random_int4_weight(16, 128, group, asymmetric, seed=0)
    exact = dequantize(qweight, scales, zeros, 4, group)
    rewritten = dequantized_tinygemm_weight(qweight, scales, zeros, group)
    assert (rewritten - exact).norm() / exact.norm() < 4e-3  # bf16 scales and offsets: 2^-9 each


@pytest.mark.skipif(CUDA, reason="checks what a machine without a GPU does")
def test_lowering_for_cuda_without_a_gpu_saves_the_ir_for_the_gpu_to_compile(tmp_path):
    graph = build_toy_transformer()
    placeholder = lower(graph, BackendOptions(max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, device="cuda"))
    assert isinstance(placeholder, CompiledWhereLoaded)
    assert placeholder.save(tmp_path) == []
    with pytest.raises(OptionError, match="sees no CUDA device"):
        placeholder.run(*PREFILL)


# -- on a GPU ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 against the interpreter, bit for bit nearly
    graph = build_toy_transformer()
    return graph, lower(graph, BackendOptions(max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, device="cuda"))


@gpu
def test_prefill_then_captured_decode_matches_the_interpreter(on_gpu):
    graph, executable = on_gpu
    executable.reset()
    oracle = InterpreterOracle(graph)
    for feeds in [PREFILL] + [decode_feeds(step) for step in range(6)]:
        torch.testing.assert_close(executable.run(*feeds), oracle.run(*feeds), atol=1e-4, rtol=1e-4)
    assert executable.captured_batches == [2]  # one CUDA graph for batch 2, replayed
    for mine, expected in zip(executable.caches, oracle.caches):
        torch.testing.assert_close(mine.cpu(), expected, atol=1e-4, rtol=1e-4)


@gpu
def test_capturing_another_batch_size_keeps_the_rows_it_warms_up_on(on_gpu):
    graph, executable = on_gpu
    executable.reset()
    oracle = InterpreterOracle(graph)
    for feeds in [PREFILL, decode_feeds(0)]:
        executable.run(*feeds), oracle.run(*feeds)
    one_row = (decode_feeds(1)[0][:1], decode_feeds(1)[1][:1])  # batch 1: a new graph, captured now
    expected = oracle.run(*one_row)
    torch.testing.assert_close(executable.run(*one_row), expected, atol=1e-4, rtol=1e-4)


@gpu
def test_last_only_and_a_later_row_on_the_gpu(on_gpu):
    _, executable = on_gpu
    executable.reset()
    tokens, positions = PREFILL[0][:1], PREFILL[1][:1]
    every = executable.run(tokens, positions)
    executable.reset()
    torch.testing.assert_close(executable.run(tokens, positions, last_only=True), every[:, -1:])
    executable.reset()
    torch.testing.assert_close(executable.run(tokens, positions, first_row=1), every, atol=1e-5, rtol=1e-5)


@gpu
@pytest.mark.parametrize("asymmetric", [False, True])
def test_tinygemm_linear_on_the_gpu_computes_the_rewritten_weight(asymmetric):
    from kiln.backends.inductor.cuda_lowerings import linear_int4_tinygemm, tinygemm_weight

    k, group = 256, 32
    qweight, scales, zeros = random_int4_weight(64, k, group, asymmetric, seed=1)
    packed, scales_and_zeros = tinygemm_weight(qweight, scales, zeros, group, "cuda")
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    out = linear_int4_tinygemm(x, packed, scales_and_zeros, None, group).float()
    weight = dequantized_tinygemm_weight(qweight, scales, zeros, group).cuda()
    expected = x.float() @ weight.T
    assert (out - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize("decode_sdpa", [False, True])
@pytest.mark.parametrize("seq", [1, 3])
def test_grouped_attention_equals_the_composite_one(seq, decode_sdpa):
    from kiln.backends.inductor.composite_ops import attention
    from kiln.backends.inductor.cuda_lowerings import grouped_attention

    torch.manual_seed(2)
    q, k, v = torch.randn(2, 6, seq, 8), torch.randn(3, 2, 16, 8), torch.randn(3, 2, 16, 8)
    positions = torch.tensor([[4 + i for i in range(seq)], [9 + i for i in range(seq)]])
    expected = attention(q, k, v, None, positions, None, None, None, 0.3, True, 0, 0.0)
    got = grouped_attention(q, k, v, positions, None, 0.3, 0, decode_sdpa)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_an_artifact_for_cuda_loads_on_the_cpu_in_f32_and_is_refused_in_bf16(tiny_model_dirs, tmp_path):
    import kiln

    checkpoint = tiny_model_dirs("llama")
    f32 = kiln.compile(str(checkpoint), out=tmp_path / "f32.kiln", device="cuda", max_seq_len=32)
    prompt = prompts([5])[0]
    on_cpu = kiln.load(f32, device="cpu").generate(prompt, max_new_tokens=6, temperature=0)
    expected = hf_greedy(load_model(checkpoint).model, prompt, 6, {EOS_TOKEN_ID})
    assert on_cpu.token_ids == expected
    bf16 = kiln.compile(str(checkpoint), out=tmp_path / "bf16.kiln", device="cuda", dtype="bf16", max_seq_len=32)
    with pytest.raises(OptionError, match="compiled for a GPU in bf16"):
        kiln.load(bf16, device="cpu")


def test_int4_calls_of_many_rows_dequantize_instead_of_tinygemm():
    from kiln.backends.inductor.cuda_lowerings import TINYGEMM_ROWS, linear_int4_cuda
    from kiln.ir.ops.quantized import linear_q_reference

    group = 32
    qweight, scales, zeros = random_int4_weight(16, 64, group, True, seed=3)
    x = torch.randn(1, TINYGEMM_ROWS + 1, 64)
    # no packed weight here (tinygemm is CUDA's): a call of more rows never reads it
    got = linear_int4_cuda(x, None, None, qweight, scales, zeros, None, group)
    torch.testing.assert_close(got, linear_q_reference(x, qweight, scales, zeros, None, 4, group))
