"""The fused decode attention of the CUDA path (backends/inductor/cuda_decode_attention.py, its
Triton kernel in cuda_decode_kernel.py, the rewrite in cuda_decode_fusion.py).

Here, without a GPU: the Triton kernel run by Triton's interpreter (TRITON_INTERPRET=1, which
conftest.py sets through triton_mode.py before Triton loads) against the op's torch reference;
the rewrite on every architecture's decode module, run on the CPU (the op's reference), giving
Hugging Face's greedy tokens; and Inductor compiling the rewritten module writes the caches in
place (no copy of a cache a step).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx

from hf_oracle import hf_greedy, prompts
from kiln.backends.executable import BackendOptions
from kiln.backends.inductor import graph_to_fx
from kiln.backends.inductor.cuda_decode_attention import decode_attention_reference
from kiln.backends.inductor.cuda_decode_fusion import fuse_decode_attention
from kiln.backends.inductor.executable import allocate_caches
from kiln.backends.token_trees import tree_feeds
from kiln.frontend.capture import capture_causal_lm
from kiln.frontend.checkpoint import load_model
from kiln.passes.pipeline import run_pipeline
from tiny_models import ARCHITECTURES, EOS_TOKEN_ID


# -- the kernel --------------------------------------------------------------------------------
def decode_inputs(batch, heads, kv_heads, dim, half, dtype, rows=3, slots=40, seed=0):
    """q, k, v as views of one projection's output (as the graph passes them), caches, tables."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    q_end, k_end = heads * dim, (heads + kv_heads) * dim

    def heads_of(part, count):
        return part.reshape(batch, 1, count, dim).permute(0, 2, 1, 3)

    q = heads_of(qkv[..., :q_end], heads)
    k, v = heads_of(qkv[..., q_end:k_end], kv_heads), heads_of(qkv[..., k_end:], kv_heads)
    caches = [torch.randn(rows, kv_heads, slots, dim, generator=generator).to(dtype) for _ in range(2)]
    tables = (None, None)
    if half:
        angles = torch.randn(slots, half, generator=generator)
        tables = angles.cos().to(dtype), angles.sin().to(dtype)
    return q, k, v, caches, tables


def on_device(tensors):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(tensors, torch.Tensor):
        return tensors.to(device)
    return type(tensors)(on_device(t) for t in tensors) if tensors is not None else None


SHAPES = [  # batch, heads, kv heads, head dim, rope half (0: none), window
    (1, 9, 3, 64, 32, 0),  # SmolLM2's heads
    (2, 4, 2, 64, 32, 0),
    (2, 8, 2, 128, 32, 5),  # partial rotary, a sliding window
    (1, 4, 4, 64, 0, 0),  # no rope, one query head a kv head
    (2, 6, 2, 80, 40, 0),  # a head dim that is not a power of two
]


@pytest.mark.parametrize("chunk", [None, 8])  # one program per (row, kv head), or the slots split by 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_triton_kernel_computes_the_reference(shape, dtype, chunk):
    pytest.importorskip("triton", reason="Triton is not installed (the dev extra installs it)")
    from kiln.backends.inductor.cuda_decode_attention import launch_decode_attention

    batch, heads, kv_heads, dim, half, window = shape
    tensors = decode_inputs(batch, heads, kv_heads, dim, half, dtype)
    q, k, v, (k_cache, v_cache), (cos, sin) = on_device(tensors)  # interpreted here, compiled on a GPU
    positions = torch.tensor([[17], [3]], device=k_cache.device)[:batch]  # one row deep in its slots, one early
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected = decode_attention_reference(q, k, v, expected_k, expected_v, cos, sin, positions, 0.125, window)
    got = launch_decode_attention(q, k, v, k_cache, v_cache, cos, sin, positions, 0.125, window, chunk)
    # f32 to its rounding; half: the interpreter's bf16 conversion truncates (one unit in the last place)
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(k_cache, expected_k, atol=tolerance, rtol=tolerance)
    assert torch.equal(v_cache, expected_v)
    untouched = torch.ones(k_cache.size(2), dtype=torch.bool, device=k_cache.device)
    untouched[positions[0, 0]] = False
    assert torch.equal(k_cache[0, :, untouched], expected_k[0, :, untouched])


def test_a_window_sees_its_last_slots_alone():
    q, k, v, (k_cache, v_cache), (cos, sin) = decode_inputs(1, 4, 2, 8, 4, torch.float32)
    positions = torch.tensor([[10]])
    windowed = decode_attention_reference(q, k, v, k_cache.clone(), v_cache.clone(), cos, sin, positions, 0.3, 3)
    k_cache[:, :, :8] = 100.0  # slots 8 and before are outside a window of 3 at position 10
    again = decode_attention_reference(q, k, v, k_cache, v_cache, cos, sin, positions, 0.3, 3)
    torch.testing.assert_close(windowed, again)


# -- the rewrite -------------------------------------------------------------------------------
def decode_module_for(model):
    options = BackendOptions(max_batch=1, max_seq_len=64)
    graph = run_pipeline(capture_causal_lm(model, options.max_batch, options.max_seq_len), options)
    module = graph_to_fx(graph, state=allocate_caches(graph), lowering_for="cuda")
    decode = fx.GraphModule(module, copy.deepcopy(module.graph))  # the caches shared, as the executable does
    decode.input_names = module.input_names
    return module, decode, fuse_decode_attention(decode), graph


def step(module, tokens: list[int], start: int) -> torch.Tensor:
    ids, positions = torch.tensor([tokens]), torch.arange(start, start + len(tokens))[None]
    extra = tree_feeds(positions, None, None) if "slots" in module.input_names else ()
    with torch.no_grad():
        return module(ids, positions, *extra)[0]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_layer_fuses_and_gives_hugging_faces_greedy_tokens(tiny_model_dirs, arch):
    model = load_model(tiny_model_dirs(arch)).model
    prefill, decode, fused, graph = decode_module_for(model)
    assert fused == sum(n.op == "attention" for n in graph.nodes)
    targets = [n.target for n in decode.graph.nodes if n.op == "call_function"]
    assert not any("kv_write" in str(t) or "grouped_attention" in str(t) for t in targets)
    prompt = prompts([9])[0]
    expected = hf_greedy(model, prompt, 12, {EOS_TOKEN_ID})
    got = [int(step(prefill, prompt, 0)[0, -1].argmax())]
    position = len(prompt)
    while len(got) < 12 and got[-1] != EOS_TOKEN_ID:
        got.append(int(step(decode, got[-1:], position)[0, -1].argmax()))
        position += 1
    assert got == expected


def test_the_reference_is_what_the_unfused_graph_computes(tiny_model_dirs):
    """Decode logits through the rewritten module equal the unfused module's, step by step."""
    model = load_model(tiny_model_dirs("llama")).model
    prefill, decode, _, _ = decode_module_for(model)
    unfused = fx.GraphModule(prefill, copy.deepcopy(prefill.graph))
    unfused.input_names = prefill.input_names
    prompt = prompts([9])[0]
    step(prefill, prompt, 0)
    for offset, token in enumerate([5, 17, 33]):
        caches = {name: buffer.clone() for name, buffer in prefill.named_buffers()}
        expected = step(unfused, [token], len(prompt) + offset)
        for name, buffer in prefill.named_buffers():
            buffer.copy_(caches[name])
        torch.testing.assert_close(step(decode, [token], len(prompt) + offset), expected, atol=1e-5, rtol=1e-5)


def test_inductor_writes_the_caches_in_place(tiny_model_dirs):
    """Compiled by Inductor (here for the CPU), the op mutating the caches stays in place: no
    copy of a cache a step, which on a GPU would cost more than the kernel saves."""
    from torch._inductor.utils import run_and_get_code

    from kiln.backends.inductor.cuda_decode_fusion import use_triton_gemv

    model = load_model(tiny_model_dirs("llama")).model
    _, decode, _, _ = decode_module_for(model)
    use_triton_gemv(decode)  # its op traced by Inductor too
    compiled = torch.compile(decode, backend="inductor")
    before = {name: buffer.clone() for name, buffer in decode.named_buffers()}
    _, (code, *_) = run_and_get_code(step, compiled, [5], 3)
    changed = [name for name, buffer in decode.named_buffers() if not torch.equal(buffer, before[name])]
    assert changed and all(".k." in name or ".v." in name or "cache" in name for name in changed)
    assert "decode_attention" in code and "kiln_cuda.gemv" in code
    assert "copy_" not in code and "clone" not in code, code


# -- on a GPU ---------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bench/gpu_run.sh runs it on one)")
@pytest.mark.parametrize("attention, linear", [("fused", "inductor"), ("matmul", "triton"), ("fused", "triton")])
def test_the_executable_under_the_switches_matches_the_interpreter(monkeypatch, attention, linear):
    """KILN_CUDA_DECODE_ATTENTION=fused and KILN_CUDA_DECODE_LINEAR=triton: prefill unfused,
    captured decode steps through Kiln's Triton kernels, logits and caches as the interpreter
    computes them."""
    from kiln.backends.inductor import lower
    from test_inductor_backend import PREFILL, InterpreterOracle, build_toy_transformer, decode_feeds

    monkeypatch.setenv("KILN_CUDA_DECODE_ATTENTION", attention)
    monkeypatch.setenv("KILN_CUDA_DECODE_LINEAR", linear)
    torch.backends.cuda.matmul.allow_tf32 = False
    graph = build_toy_transformer()
    executable = lower(graph, BackendOptions(max_batch=2, max_seq_len=32, device="cuda"))
    oracle = InterpreterOracle(graph)
    for feeds in [PREFILL] + [decode_feeds(step) for step in range(6)]:
        torch.testing.assert_close(executable.run(*feeds), oracle.run(*feeds), atol=1e-4, rtol=1e-4)
    code = executable._decode._orig_mod.code
    assert ("decode_attention" in code) == (attention == "fused") and ("gemv" in code) == (linear == "triton")
    for mine, expected in zip(executable.caches, oracle.caches):
        torch.testing.assert_close(mine.cpu(), expected, atol=1e-4, rtol=1e-4)
