"""Kiln's fp32 linear over panel-major weights (`kiln::linear_f32_panels`, gemv_panels.h):
correctness only, no timings.

Every row count (one token, a few, a batched decode's 16, prefill's hundreds), odd N and K, the
narrow last panel, each instruction set this CPU has: against float64, and every row the same
bits as it alone, whatever the thread count or instruction set (one FMA chain per output, in k
order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.backends.inductor import gemv_kernel as gk

SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (67, 130), (33, 17), (1000, 40), (4100, 64), (7, 3)]


pytestmark = pytest.mark.usefixtures("gemv_kernels_two_threads")


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.02, torch.randn(n, generator=g) * 0.02


def _run(x, panels, bias, isa):
    torch.ops.kiln.gemv_use_avx512(isa == "avx512")
    return gk.linear_f32_panels(x, panels, bias)


def _isas():
    return ["avx512", "avx2"] if torch.ops.kiln.gemv_use_avx512(True) else ["avx2"]


def test_packing_cuts_the_transposed_weight_into_panels():
    w = torch.arange(100 * 7, dtype=torch.float32).view(100, 7)  # N = 100: panels of 32, the last of 4
    panels = gk.pack_linear_weight(w, "panels")
    assert panels.shape == (7, 100) and panels.is_contiguous() and gk.panel_width(100) == 32
    flat = panels.view(-1)
    for c in range(0, 100, 32):
        n = min(32, 100 - c)
        assert torch.equal(flat[c * 7 : (c + n) * 7].view(7, n), w[c : c + n].t())
    assert gk.panel_width(3072) == gk.panel_width(49152) == 64 and gk.panel_width(960) == 32


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_row_count_matches_float64_and_the_row_alone(n, k):
    w, b = _weights(n, k, seed=n)
    panels = gk.pack_linear_weight(w, "panels")
    x_all = torch.randn(200, k, generator=torch.Generator().manual_seed(k))
    for isa in _isas():
        alone = torch.cat([_run(row[None], panels, b, isa) for row in x_all])
        for m in [*range(1, 65), 129, 200]:
            x = x_all[:m]
            got = _run(x, panels, b, isa)
            ref = F.linear(x.double(), w.double(), b.double())
            assert (got - ref).abs().max().item() < 1e-4, (isa, n, k, m)
            assert torch.equal(got, alone[:m]), (isa, n, k, m)
    if len(_isas()) == 2:  # one order of sums: the instruction sets agree bit for bit
        x = x_all[:13]
        assert torch.equal(_run(x, panels, b, "avx512"), _run(x, panels, b, "avx2"))


def test_threads_bias_leading_dims_and_empty_k():
    w, b = _weights(960, 576)
    panels = gk.pack_linear_weight(w, "panels")
    x = torch.randn(2, 5, 576)
    two = gk.linear_f32_panels(x, panels, b)
    torch.set_num_threads(1)
    try:
        one = gk.linear_f32_panels(x, panels, b)
    finally:
        torch.set_num_threads(2)
    assert two.shape == (2, 5, 960) and torch.equal(one, two)
    assert torch.equal(two.view(10, 960), gk.linear_f32_panels(x.view(10, 576), panels, b))
    no_bias = gk.linear_f32_panels(x, panels)
    torch.testing.assert_close(no_bias, F.linear(x, w), atol=1e-5, rtol=1e-5)
    empty = gk.pack_linear_weight(torch.randn(40, 0), "panels")
    bias = torch.randn(40)
    assert torch.equal(gk.linear_f32_panels(torch.randn(3, 0), empty, bias), bias.expand(3, 40))


def test_bad_inputs_name_the_problem():
    w, _ = _weights(64, 32)
    panels = gk.pack_linear_weight(w, "panels")
    with pytest.raises(RuntimeError, match="K=31"):
        gk.linear_f32_panels(torch.randn(1, 31), panels)
    with pytest.raises(RuntimeError, match="width must be 32 or 64"):
        torch.ops.kiln.linear_f32_panels(torch.randn(1, 32), panels, 48, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.kiln.linear_f32_panels(torch.randn(1, 64), torch.randn(64, 128)[:, ::2], 32, None)
    with pytest.raises(ValueError, match="'panels'"):
        gk.pack_linear_weight(w, "rows")


def test_fake_impl_and_torch_compile():
    w, b = _weights(192, 576)
    panels = gk.pack_linear_weight(w, "panels")
    for m in (1, 3, 64):
        x = torch.randn(m, 576)
        torch.library.opcheck(torch.ops.kiln.linear_f32_panels.default, (x, panels, 32, b))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.ops.kiln.linear_f32_panels(x, panels, 32, b).relu(), fullgraph=True)
    x = torch.randn(4, 576)
    assert torch.equal(compiled(x), gk.linear_f32_panels(x, panels, b).relu())
