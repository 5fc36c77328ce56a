"""The int8 KV cache (`kv_cache="int8"`): codes with one scale per token and head, quantized by
`kv_quantize` on write and read by `attention` (the interpreter, Inductor's kernel); the options
that ask for it, and the backends that refuse it."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from kiln.backends.cache_rows import copy_prefix
from kiln.backends.executable import BackendOptions
from kiln.compile_options import CompileOptions, kv_cache_bytes
from kiln.frontend.checkpoint import load_model
from kiln.ir.errors import KilnError, OptionError, UnsupportedOpError
from kiln.ir.ops.attention import attention_reference
from kiln.ir.ops.kv_quant import dequantize_kv, kv_quantize_reference

MAX_BATCH, MAX_SEQ_LEN = 2, 64
F32, INT8 = BackendOptions(MAX_BATCH, MAX_SEQ_LEN), BackendOptions(MAX_BATCH, MAX_SEQ_LEN, kv_cache="int8")


@functools.cache
def stateful_graph(model_dir, options: BackendOptions):
    from kiln.frontend.capture import capture_causal_lm
    from kiln.passes.pipeline import run_pipeline

    return run_pipeline(capture_causal_lm(load_model(model_dir).model, MAX_BATCH, MAX_SEQ_LEN), options)


def reference_executable(model_dir, options: BackendOptions):
    from kiln.backends.reference import lower

    return lower(stateful_graph(model_dir, options), options)


def test_kv_quantize_keeps_each_number_within_half_a_step_of_its_row():
    x = torch.randn(2, 3, 5, 16) * torch.logspace(-3, 2, 5)[:, None]  # rows of very different sizes
    x[0, 0, 0] = 0.0
    codes, scales = kv_quantize_reference(x)
    assert codes.dtype == torch.int8 and scales.shape == (2, 3, 5, 1)
    assert codes.abs().max() == 127 and scales[0, 0, 0] == 0 and not codes[0, 0, 0].any()
    torch.testing.assert_close(scales, x.abs().amax(-1, keepdim=True) / 127)
    assert ((dequantize_kv(codes, scales) - x).abs() <= scales / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize(
    "batch,heads,kv_heads,seq,head_dim,window,with_tree",
    [
        (1, 9, 3, 1, 64, 0, False),  # SmolLM2 decode
        (6, 9, 3, 1, 64, 0, False),  # SmolLM2 batched decode: the threads split rows, not a row's heads
        (2, 4, 2, 3, 20, 0, True),  # a few queries with a tree, head dim not a multiple of 8
        (3, 8, 2, 8, 64, 7, False),  # sliding window
        (2, 6, 3, 24, 32, 0, True),  # a prefill chunk: ATen's attention over the used slots, dequantized
    ],
)
def test_the_kernel_reads_an_int8_cache_like_the_irs_attention(
    batch, heads, kv_heads, seq, head_dim, window, with_tree
):
    from kiln.backends.inductor import fast_attention

    if not fast_attention.kernel_available():
        pytest.skip("the attention kernel cannot be built here")
    generator = torch.Generator().manual_seed(seq * 31 + heads)
    q = torch.randn(batch, heads, seq, head_dim, generator=generator)
    (k, k_scales), (v, v_scales) = (
        kv_quantize_reference(torch.randn(batch + 1, kv_heads, 48, head_dim, generator=generator)) for _ in range(2)
    )
    positions = torch.randint(0, 48 - seq + 1, (batch, 1), generator=generator) + torch.arange(seq)
    tree = torch.rand(batch, seq, seq, generator=generator).tril() > 0.4 if with_tree else None
    if tree is not None:
        tree |= torch.eye(seq, dtype=torch.bool)
    expected = attention_reference(
        q, k, v, None, positions, tree, k_scales, v_scales, scale=None, causal=False, window=window, softcap=0.0
    )
    scale = 1 / math.sqrt(head_dim)
    actual = torch.ops.kiln.cached_attention(q, k, v, positions, scale, window, tree, k_scales, v_scales)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    if seq <= 16:  # batch invariance of the few-queries kernel: each row bit for bit as alone (int8 and f32)
        k32, v32 = k.float() * k_scales, v.float() * v_scales
        together = torch.ops.kiln.cached_attention(q, k32, v32, positions, scale, window, tree, None, None)
        for b in range(batch):
            one = slice(b, b + 1)
            tree_b = None if tree is None else tree[one]
            alone = torch.ops.kiln.cached_attention(
                q[one], k[one], v[one], positions[one], scale, window, tree_b, k_scales[one], v_scales[one]
            )
            assert torch.equal(alone[0], actual[b]), b
            alone = torch.ops.kiln.cached_attention(q[one], k32[one], v32[one], positions[one], scale, window, tree_b)
            assert torch.equal(alone[0], together[b]), b


def test_the_graph_holds_codes_and_scales_beside_them(tiny_model_dirs):
    graph = stateful_graph(tiny_model_dirs("llama"), INT8)
    caches = {v.name: v.type for v in graph.inputs if v.name.startswith("cache.")}
    assert str(caches["cache.k.0"]) == "i8[2, 2, 64, 16]" and str(caches["cache.v_scale.0"]) == "f32[2, 2, 64, 1]"
    assert len(caches) == 4 * graph.meta["kv_cache"]["layers"] and graph.meta["kv_cache"]["kind"] == "int8"
    assert sum(n.op == "kv_quantize" for n in graph.nodes) == 2 * graph.meta["kv_cache"]["layers"]


def test_int8_cache_logits_stay_close_to_the_f32_caches(tiny_model_dirs):
    """Each cached number is off by at most half a step: 1/254 of its row's largest magnitude.
    The tiny model's weights are ten times a trained model's scale (INITIALIZER_RANGE), so those
    errors grow through its layers; its logits (spread ~1.6, largest ~6) move by ~0.15 at most.
    Bound: 0.05 of the largest logit; and every greedy choice that is not a near tie under the
    f32 cache (its lead over the runner-up more than twice that bound) stays the same."""
    tokens = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kind, options in (("f32", F32), ("int8", INT8)):
        executable = reference_executable(tiny_model_dirs("llama"), options)
        prefill = executable.run(tokens[:, :32], torch.arange(32).expand(2, -1))
        decoded = [executable.run(tokens[:, t : t + 1], torch.full((2, 1), t)) for t in range(32, 40)]
        logits[kind] = torch.cat([prefill, *decoded], dim=1)
    bound = 0.05 * logits["f32"].abs().max()
    assert 0 < (logits["int8"] - logits["f32"]).abs().max() < bound
    top2 = logits["f32"].topk(2, dim=-1).values
    clear = top2[..., 0] - top2[..., 1] > 2 * bound
    assert clear.sum() >= 20  # of 80 choices (this random model's logits are flat)
    assert torch.equal(logits["int8"].argmax(-1)[clear], logits["f32"].argmax(-1)[clear])


def test_a_copied_prefix_carries_its_scales(tiny_model_dirs):
    """Prefix caching copies rows of every cache buffer, scales included: a continuation in the
    copied row equals one in the row the prefix was computed in."""
    executable = reference_executable(tiny_model_dirs("llama"), INT8)
    assert len(executable.cache_views()) == 4 * 2  # codes and scales of k and v, per layer
    tokens = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    executable.reset()
    executable.run(tokens[:, :20], torch.arange(20)[None])
    copy_prefix(executable.cache_views(), 0, 1, 20)
    in_copy = executable.run(tokens[:, 20:], torch.arange(20, 24)[None], first_row=1)
    in_place = executable.run(tokens[:, 20:], torch.arange(20, 24)[None])
    torch.testing.assert_close(in_copy, in_place, atol=0, rtol=0)


def greedy(executable, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuations [batch, steps] of equal-length prompts (one compiled shape per phase)."""
    executable.reset()
    batch, length = prompts.shape
    logits = executable.run(prompts, torch.arange(length).expand(batch, -1))
    chosen = [logits[:, -1].argmax(-1, keepdim=True)]
    for position in range(length, length + steps - 1):
        chosen.append(executable.run(chosen[-1], torch.full((batch, 1), position))[:, -1].argmax(-1, keepdim=True))
    return torch.cat(chosen, dim=1)


@pytest.mark.slow
def test_inductor_reads_the_int8_cache_like_the_interpreter(tiny_model_dirs):
    """Inductor quantizes in its own fused kernel, where a number halfway between two codes may
    round the other way (one step: 1/127 of its row's largest magnitude), so logits agree to 5e-3,
    not the 1e-4 of f32 caches."""
    from kiln.backends.inductor import lower

    model = tiny_model_dirs("llama")
    compiled = lower(stateful_graph(model, INT8), INT8)
    reference = reference_executable(model, INT8)
    tokens = torch.randint(3, 500, (2, 30), generator=torch.Generator().manual_seed(2))
    for executable in (compiled, reference):
        executable.reset()
    for start, end in ((0, 20), (20, 21), (21, 25), (25, 26)):  # prefill, decode, a short chunk, decode
        positions = torch.arange(start, end).expand(2, -1)
        expected = reference.run(tokens[:, start:end], positions)
        torch.testing.assert_close(compiled.run(tokens[:, start:end], positions), expected, atol=5e-3, rtol=0)
    assert torch.equal(greedy(compiled, tokens[:, :12], 16), greedy(reference, tokens[:, :12], 16))


def test_backends_without_an_int8_cache_refuse_it(tiny_model_dirs, tmp_path):
    for backend in ("onnxruntime", "tinygrad"):
        with pytest.raises(OptionError, match=f"not supported by the {backend} backend.*Fix: backend='inductor'"):
            CompileOptions.checked(model=None, out=tmp_path / "m.kiln", backend=backend, kv_cache="int8")
    from kiln.backends.onnxruntime import lower

    with pytest.raises(UnsupportedOpError, match="onnxruntime backend cannot run an int8 KV cache.*--kv-cache f32"):
        lower(stateful_graph(tiny_model_dirs("llama"), INT8), INT8)


def test_the_option_is_checked_recorded_and_absent_means_f32(tmp_path):
    from kiln.api import backend_options
    from kiln.runtime.errors import ArtifactError

    for bad in ("int4", "INT8", None, 8):
        with pytest.raises(OptionError, match="kv_cache .* is not a KV-cache kind.*Fix"):
            CompileOptions.checked(model=None, out=tmp_path / "m.kiln", kv_cache=bad)
    options = CompileOptions.checked(model=None, out=tmp_path / "m.kiln", kv_cache="int8")
    assert options.manifest_options(None)["kv_cache"] == "int8"
    assert backend_options({"max_batch": 2}).kv_cache == "f32"  # an artifact compiled before the option
    with pytest.raises(ArtifactError, match="kv_cache='int4'") as info:
        backend_options({"kv_cache": "int4"})
    assert isinstance(info.value, KilnError)


def test_an_int8_cache_takes_fewer_bytes_per_token():
    class Config:  # SmolLM2-135M's shape
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 30, 9, 3, 576

    f32, int8 = (
        kv_cache_bytes(Config, CompileOptions(model=None, out="m.kiln", max_seq_len=2048, kv_cache=kind))
        for kind in ("f32", "int8")
    )
    rope_tables = 64 * 4 * 2048
    assert (f32 - rope_tables) / 2048 == 2 * 30 * 3 * 64 * 4  # 46,080 bytes per token
    assert (int8 - rope_tables) / 2048 == 2 * 30 * 3 * (64 + 4)  # 12,240: 3.8x fewer
