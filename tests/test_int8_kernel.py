"""`kiln::linear_q8` (int8_kernel.cpp): int8 weights x int8-rounded activations.

Checked against `int8_kernel.reference` (float64 F.linear of x rounded per block of 32 as the
kernel rounds it, times the dequantized weight) for every M the kernel takes (1..64), each row
bit for bit its one-row result (batch invariance), odd N, each instruction set this CPU has
(AVX-512 VNNI and the AVX2 baseline), with and without bias;
above 64 rows the op runs the f32 GEMM on the unrounded x. One slow test runs SmolLM2-135M int8
through the lowering (eagerly) and compares its greedy tokens with the interpreter's (~60 s).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.backends.inductor import int8_kernel as ik

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def loaded():
    ik.ensure_loaded()
    yield
    torch.ops.kiln.linear_q8_use_vnni(True)


@pytest.fixture(params=["vnni", "avx2"])
def isa(request):
    """Run a test on each kernel this CPU has."""
    if torch.ops.kiln.linear_q8_use_vnni(request.param == "vnni") != (request.param == "vnni"):
        pytest.skip("this CPU has no AVX-512 VNNI")
    yield request.param
    torch.ops.kiln.linear_q8_use_vnni(True)


def _weights(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    return q, torch.rand(n, generator=g) * 0.01 + 1e-3, torch.randn(n, generator=g)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("n,k", [(67, 64), (130, 576), (16, 32), (960, 576), (576, 1536)])
def test_matches_reference_for_every_m(isa, n, k):
    q, scales, bias = _weights(n, k)
    packed = ik.pack_int8_weight(q)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, k, generator=g)
    x[3, :32] = 0.0  # an all-zero block: scale 0
    alone = {
        b is None: torch.cat([torch.ops.kiln.linear_q8(x[r : r + 1], packed, scales, b) for r in range(64)])
        for b in (None, bias)
    }
    for m in range(1, 65):
        for b in (None, bias):
            got = torch.ops.kiln.linear_q8(x[:m], packed, scales, b)
            assert got.shape == (m, n)
            assert _relative_error(got, ik.reference(x[:m], q, scales, b)) < 1e-5, (isa, n, k, m, b is None)
            # batch invariance: each row bit for bit what it gets alone
            assert torch.equal(got, alone[b is None][:m]), (isa, n, k, m, b is None)


def test_rounding_error_is_small_against_f32(isa):
    """The rounding of x per block moves results by well under 1% of their range."""
    q, scales, bias = _weights(576, 576)
    x = torch.randn(5, 576)
    exact = F.linear(x, q.float() * scales[:, None], bias)
    got = torch.ops.kiln.linear_q8(x, ik.pack_int8_weight(q), scales, bias)
    assert _relative_error(got, exact.double()) < 1e-2


def test_leading_dims_and_prefill():
    q, scales, bias = _weights(130, 96)
    packed = ik.pack_int8_weight(q)
    x = torch.randn(2, 3, 96)
    assert _relative_error(torch.ops.kiln.linear_q8(x, packed, scales, bias), ik.reference(x, q, scales, bias)) < 1e-5
    x = torch.randn(ik.LARGE_M + 7, 96)  # prefill: f32 GEMM on the unrounded x
    exact = F.linear(x.double(), q.double() * scales.double()[:, None], bias.double())
    assert _relative_error(torch.ops.kiln.linear_q8(x, packed, scales, bias), exact) < 1e-5


def test_packing_and_errors():
    q, scales, _ = _weights(17, 64)
    packed = ik.pack_int8_weight(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 16, 64)
    assert packed[0, 0, :4].tolist() == (q[0, :4].int() + 128).tolist()
    assert packed[1, 0, 4:].eq(128).all()  # padding channels: zero weights
    with pytest.raises(ValueError, match="multiple of 32"):
        ik.pack_int8_weight(torch.zeros(4, 48, dtype=torch.int8))
    with pytest.raises(ValueError, match="-127..127"):
        ik.pack_int8_weight(torch.full((4, 32), -128, dtype=torch.int8))
    odd_k = torch.zeros(1, 12, 64, dtype=torch.uint8)  # K = 48
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kiln.linear_q8(torch.randn(1, 48), odd_k, torch.ones(16))
    with pytest.raises(RuntimeError, match="x has K"):
        torch.ops.kiln.linear_q8(torch.randn(1, 32), packed, scales)
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.kiln.linear_q8(torch.randn(1, 64), packed, torch.ones(40))
    assert ik.supports(576) and not ik.supports(48)


def test_opcheck_and_compile():
    q, scales, bias = _weights(40, 64)
    packed = ik.pack_int8_weight(q)
    x = torch.randn(3, 64)
    torch.library.opcheck(
        torch.ops.kiln.linear_q8.default, (x, packed, scales, bias), test_utils=("test_schema", "test_faketensor")
    )
    compiled = torch.compile(lambda a: torch.ops.kiln.linear_q8(a, packed, scales, bias), fullgraph=True)
    assert torch.equal(compiled(x), torch.ops.kiln.linear_q8(x, packed, scales, bias))


def _greedy(step, prompt: torch.Tensor, count: int) -> list[int]:
    """`count` greedy tokens after `prompt` (one prefill, then one token per step)."""
    logits = step(prompt[None], torch.arange(len(prompt))[None])
    tokens = [int(logits[0, -1].argmax())]
    for position in range(len(prompt), len(prompt) + count - 1):
        logits = step(torch.tensor([[tokens[-1]]]), torch.tensor([[position]]))
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


@pytest.mark.slow
def test_int8_smollm2_greedy_tokens_match_f32_activations(smollm2_dir):
    """SmolLM2-135M int8 (lm_head too) lowered to linear_q8, run eagerly: the greedy tokens of the
    interpreter (f32 activations), bar at most a late divergence."""
    from kiln.backends import reference
    from kiln.backends.executable import BackendOptions
    from kiln.backends.inductor import graph_to_fx
    from kiln.backends.inductor.executable import allocate_caches
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.passes.pipeline import run_pipeline
    from kiln.runtime.tokenizer import Tokenizer

    options = BackendOptions(max_seq_len=64, quantize="int8", quantize_embeddings=True)
    graph = run_pipeline(capture_causal_lm(load_model(smollm2_dir).model, max_batch=1, max_seq_len=64), options)
    assert sum(n.op == "linear_q" for n in graph.nodes) == 30 * 4 + 1
    module = graph_to_fx(graph, state=allocate_caches(graph))
    assert "linear_q8" in module.code
    oracle = reference.lower(graph, options)
    prompt = torch.tensor(
        Tokenizer.from_dir(smollm2_dir).encode("The whale swam slowly toward the ship, and", add_special_tokens=False)
    )
    with torch.no_grad():
        got = _greedy(lambda t, p: module(t, p)[0], prompt, 24)
    want = _greedy(oracle.run, prompt, 24)
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    assert same >= 16, (got, want)
