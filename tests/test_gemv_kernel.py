"""Kiln's C++ linear kernels (backends/inductor/gemv_kernel.*): correctness only, no timings.

The ops `kiln::linear_f32` / `kiln::linear_i8` must match F.linear for the SmolLM2-135M shapes
at decode (M = 1), small batches (M = 2..8), many rows (M = 9..64: verification, batched decode,
with the AVX-512 and the AVX2 kernel; every row bit-identical to it alone) and prefill (M <= 128
the same kernel, M > 128 the MKL path), with and without bias, any leading dims, 1 or 2 threads,
and inside `torch.compile(fullgraph=True)`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kiln.backends.inductor import gemv_kernel as gk

# (N, K) of nn.Linear weights: q/o, k/v, fused qkv, gate/up, fused gate_up, down, lm_head.
SMOL_SHAPES = [(576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536), (49152, 576)]
# Tails of every kind: N, K not multiples of 8/16, K smaller than the row unroll.
ODD_SHAPES = [(1, 1), (7, 3), (8, 8), (13, 7), (17, 33), (100, 5), (24, 40), (40, 24)]
MS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 128, 129]


pytestmark = pytest.mark.usefixtures("gemv_kernels_two_threads")


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    # real-model scale (HF init std 0.02): outputs O(1), so 1e-4 absolute is meaningful in fp32
    return torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g) * 0.02


@pytest.mark.parametrize("n,k", SMOL_SHAPES + ODD_SHAPES)
def test_linear_f32_matches_f_linear(n, k):
    w, b = _weights(n, k)
    g = torch.Generator().manual_seed(1)
    for layout in ("kn", "nk", "auto"):
        wt = gk.pack_linear_weight(w, layout)
        assert wt.shape == (k, n)
        if n > 1 and k > 1:  # a [1, K] or [K, 1] tensor is both
            assert gk.packed_layout(wt) == (layout if layout != "auto" else "kn")
        for m in MS:
            x = torch.randn(m, k, generator=g)
            for bias in (None, b):
                got = torch.ops.kiln.linear_f32(x, wt, bias)
                ref = F.linear(x, w, bias)
                assert got.shape == ref.shape
                assert (got - ref).abs().max().item() < 1e-4, (n, k, m, layout, bias is None)


@pytest.mark.parametrize("n,k", [(576, 1536), (49152, 576)])
def test_linear_f32_unscaled_data_is_fp32_accurate(n, k):
    """With N(0,1) weights (outputs ~sqrt(K) ~ 30) absolute 1e-4 is below fp32 resolution for
    any summation order: bound the error relative to the output scale, against float64."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=g)
    wt = gk.pack_linear_weight(w, "kn")
    for m in (1, 4):
        x = torch.randn(m, k, generator=g)
        ref = F.linear(x.double(), w.double())
        err_kiln = (torch.ops.kiln.linear_f32(x, wt) - ref).abs().max().item()
        assert err_kiln < 1e-5 * ref.abs().max().item(), err_kiln


def test_leading_dims_noncontiguous_and_threads():
    w, b = _weights(960, 576)
    wt = gk.pack_linear_weight(w)
    x = torch.randn(2, 3, 576)
    got_nk = torch.ops.kiln.linear_f32(x, gk.pack_linear_weight(w, "nk"), b)
    assert torch.allclose(got_nk, F.linear(x, w, b), atol=1e-4, rtol=0)
    assert torch.allclose(torch.ops.kiln.linear_f32(x, wt, b), F.linear(x, w, b), atol=1e-4, rtol=0)
    xt = torch.randn(576, 4).t()  # non-contiguous [4, 576]
    assert torch.allclose(torch.ops.kiln.linear_f32(xt, wt, b), F.linear(xt, w, b), atol=1e-4, rtol=0)
    x1 = torch.randn(1, 1, 576)
    y2 = torch.ops.kiln.linear_f32(x1, wt, b)
    torch.set_num_threads(1)
    try:
        y1 = torch.ops.kiln.linear_f32(x1, wt, b)
    finally:
        torch.set_num_threads(2)
    assert y2.shape == (1, 1, 960)
    assert torch.allclose(y1, y2, atol=1e-5, rtol=0)
    empty = torch.ops.kiln.linear_f32(torch.randn(0, 576), wt, b)
    assert empty.shape == (0, 960)


def test_pack_fused_projection():
    wq, _ = _weights(576, 576, 1)
    wk, _ = _weights(192, 576, 2)
    wv, _ = _weights(192, 576, 3)
    wt = gk.pack_linear_weight(torch.cat([wq, wk, wv]))
    assert gk.packed_layout(wt) == "kn"
    x = torch.randn(1, 576)
    q, k, v = torch.ops.kiln.linear_f32(x, wt).split([576, 192, 192], dim=-1)
    for got, w in ((q, wq), (k, wk), (v, wv)):
        assert (got - F.linear(x, w)).abs().max().item() < 1e-4


@pytest.mark.parametrize("n,k", SMOL_SHAPES[:6] + ODD_SHAPES)
def test_linear_i8_matches_dequantized(n, k):
    w, b = _weights(n, k)
    wq, scales = gk.pack_linear_weight_int8(w)
    assert wq.dtype == torch.int8 and wq.shape == (k, n) and scales.shape == (n,)
    w_deq = wq.t().float() * scales[:, None]
    assert (w_deq - w).abs().max().item() <= scales.max().item() / 2 + 1e-7  # round-to-nearest
    g = torch.Generator().manual_seed(3)
    for m in MS:
        x = torch.randn(m, k, generator=g)
        for bias in (None, b):
            got = torch.ops.kiln.linear_i8(x, wq, scales, bias)
            assert (got - F.linear(x, w_deq, bias)).abs().max().item() < 1e-4, (n, k, m)
    # and the same numbers as torch's own weight-only int8 kernel (layout [N, K])
    x = torch.randn(1, k, generator=g)
    ref = torch._weight_int8pack_mm(x, wq.t().contiguous(), scales)
    assert (torch.ops.kiln.linear_i8(x, wq, scales) - ref).abs().max().item() < 1e-4


@pytest.fixture(params=["avx512", "avx2"])
def isa(request):
    """Run a test with the many-rows kernel of each instruction set this CPU has."""
    if request.param == "avx512" and not torch.ops.kiln.gemv_use_avx512(True):
        pytest.skip("this CPU has no AVX-512")
    torch.ops.kiln.gemv_use_avx512(request.param == "avx512")
    yield request.param
    torch.ops.kiln.gemv_use_avx512(True)


@pytest.mark.parametrize("n,k", [(67, 130), (33, 17), (1000, 40), (96, 1536), (4100, 64)])
def test_every_row_count_up_to_64(isa, n, k):
    """Each M from 1 to 64 (odd and even, below and above the row blocks of 6 and 12 and the
    16-row steps), odd N and K: f32 and int8 against float64, and every row bit-identical to
    the same row alone (M = 1): the kernels add in one order whatever M (batch invariance)."""
    w, b = _weights(n, k, seed=n)
    wt, (wq, scales) = gk.pack_linear_weight(w), gk.pack_linear_weight_int8(w)
    w_deq = wq.t().double() * scales[:, None].double()
    x_all = torch.randn(64, k, generator=torch.Generator().manual_seed(k))
    alone = torch.cat([torch.ops.kiln.linear_f32(row[None], wt, b) for row in x_all])
    alone_q = torch.cat([torch.ops.kiln.linear_i8(row[None], wq, scales, b) for row in x_all])
    for m in range(1, 65):
        x = x_all[:m]
        ref = F.linear(x.double(), w.double(), b.double())
        got = torch.ops.kiln.linear_f32(x, wt, b)
        assert (got - ref).abs().max().item() < 1e-4, (isa, n, k, m)
        assert torch.equal(got, alone[:m]), (isa, n, k, m)
        ref_q = F.linear(x.double(), w_deq, b.double())
        got_q = torch.ops.kiln.linear_i8(x, wq, scales, b)
        assert (got_q - ref_q).abs().max().item() < 1e-4, (isa, n, k, m)
        assert torch.equal(got_q, alone_q[:m]), (isa, n, k, m)


def test_bad_inputs_raise():
    w, _ = _weights(64, 32)
    wt = gk.pack_linear_weight(w)
    with pytest.raises(RuntimeError, match="K=31"):
        torch.ops.kiln.linear_f32(torch.randn(1, 31), wt)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.kiln.linear_f32(torch.randn(1, 32, dtype=torch.float64), wt)
    with pytest.raises(RuntimeError, match="strides"):
        torch.ops.kiln.linear_f32(torch.randn(1, 64), torch.randn(64, 128)[:, ::2])
    with pytest.raises(RuntimeError, match="contiguous"):
        wq, s = gk.pack_linear_weight_int8(w)
        torch.ops.kiln.linear_i8(torch.randn(1, 64), wq.t(), s)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.kiln.linear_f32(torch.randn(1, 32), wt, torch.randn(63))
    with pytest.raises(ValueError):
        gk.pack_linear_weight(torch.randn(3))
    with pytest.raises(ValueError):
        gk.pack_linear_weight(w, "blocked")


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "kiln-no-such-compiler")
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    with pytest.raises(gk.KernelBuildError, match="compiler 'kiln-no-such-compiler' not found"):
        gk._build(tmp_path / "ext" / "x.so")
    with pytest.raises(gk.KernelBuildError, match="not found"):
        gk.library_path()


def test_build_is_cached():
    path = gk.library_path()
    assert path.exists()
    assert gk.ensure_loaded() == str(path)
    custom = os.environ.get("KILN_CACHE")
    if custom:
        assert str(path).startswith(custom)


def test_opcheck_fake_impls():
    w, b = _weights(192, 576)
    wt = gk.pack_linear_weight(w)
    wq, s = gk.pack_linear_weight_int8(w)
    for m in (1, 3, 64):
        x = torch.randn(m, 576)
        torch.library.opcheck(torch.ops.kiln.linear_f32.default, (x, wt, b))
        torch.library.opcheck(torch.ops.kiln.linear_i8.default, (x, wq, s, None))


class _Mlp(torch.nn.Module):
    """SwiGLU block on packed weights: fused gate/up, then down, as Kiln's backend emits it."""

    def __init__(self, hidden=576, ffn=1536):
        super().__init__()
        g, _ = _weights(ffn, hidden, 4)
        u, _ = _weights(ffn, hidden, 5)
        d, bd = _weights(hidden, ffn, 6)
        self.ref = (g, u, d, bd)
        self.register_buffer("gate_up", gk.pack_linear_weight(torch.cat([g, u])))
        self.register_buffer("down", gk.pack_linear_weight(d))
        self.register_buffer("down_bias", bd)
        q, s = gk.pack_linear_weight_int8(d)
        self.register_buffer("down_q", q)
        self.register_buffer("down_s", s)
        self.ffn = ffn

    def forward(self, x):
        gu = torch.ops.kiln.linear_f32(x, self.gate_up, None)
        gate, up = gu.split(self.ffn, dim=-1)
        h = F.silu(gate) * up
        return torch.ops.kiln.linear_f32(h, self.down, self.down_bias) + torch.ops.kiln.linear_i8(
            h, self.down_q, self.down_s, None
        )

    def reference(self, x):
        g, u, d, bd = self.ref
        h = F.silu(F.linear(x, g)) * F.linear(x, u)
        d_deq = self.down_q.t().float() * self.down_s[:, None]
        return F.linear(h, d, bd) + F.linear(h, d_deq)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    mod = _Mlp().eval()
    compiled = torch.compile(mod, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for shape in ((1, 1, 576), (1, 4, 576), (2, 32, 576)):
            x = torch.randn(*shape)
            got = compiled(x)
            assert got.shape == shape
            assert (got - mod.reference(x)).abs().max().item() < 1e-4, shape
    torch._dynamo.reset()
