"""Kiln's int4 kernel over weights packed into panels at lowering (`kiln::linear_q4_panels`,
backends/inductor/int4_panels.h) against a float reference: x rounded to int8 per block of 32 as
the kernel rounds it, times the dequantized weight (its scales rounded to f16 where the panels
hold them so), in float64; and batch invariance: every row of an M-row call (panels, or staged
per call) bit for bit the one-row kernel's result for that row alone."""

from __future__ import annotations

import pytest
import torch

from kiln.ir.ops.quantized import dequantize
from kiln.passes.round_to_nearest import quantize_weight

# (N, K, group_size, symmetric): N not a multiple of 16 (a part panel), K a single 64 or several
# blocks, groups of 32, 64 and 128 (576 % 128 != 0: a short last group)
SHAPES = [
    (37, 64, 32, True),
    (50, 576, 32, False),
    (33, 192, 64, True),
    (20, 192, 64, False),
    (45, 576, 128, True),
    (16, 576, 128, False),
]
ROWS = (1, 3, 8, 16, 17, 64)


@pytest.fixture(scope="module")
def kernel():
    from kiln.backends.inductor.quantized_linear import int4_kernel_available

    if not int4_kernel_available():
        pytest.skip("Kiln's int4 kernel does not build here")
    yield
    torch.ops.kiln.q4_use_vnni(True)
    torch.ops.kiln.q4_panels_at_one_row(False)


def reference(x, q, group_size, bias):
    from kiln.backends.inductor.int8_kernel import round_rows

    scales = q.scales if q.zeros is not None else q.scales.half().float()  # the panels' f16 scales
    w = dequantize(q.qweight, scales.double(), q.zeros, 4, group_size).double()
    return torch.nn.functional.linear(round_rows(x), w, bias.double())


@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "avx2"])
@pytest.mark.parametrize("n, k, group_size, symmetric", SHAPES)
def test_packed_panels_equal_the_float_reference(kernel, vnni, n, k, group_size, symmetric):
    from kiln.backends.inductor.int4_kernel import pack_panels

    if torch.ops.kiln.q4_use_vnni(vnni) != vnni:
        pytest.skip("this CPU has no AVX-512 VNNI")
    torch.manual_seed(n + k)
    q = quantize_weight(torch.randn(n, k), 4, group_size, symmetric)
    panels = pack_panels(q.qweight, q.scales, q.zeros, group_size)
    assert panels.shape == ((n + 15) // 16, torch.ops.kiln.q4_panel_bytes(k, not symmetric))
    half = q.scales.half() if symmetric else None
    bias = torch.randn(n)
    x_all = torch.randn(max(ROWS), k)
    torch.ops.kiln.q4_panels_at_one_row(False)
    # batch invariance: each row as the one-row kernel gives it alone (f16 scales where the panels
    # hold them; the staged kernel also with f32 scales)
    alone = torch.cat(
        [
            torch.ops.kiln.linear_q4(x_all[r : r + 1], q.qweight, q.scales, q.zeros, bias, group_size, half)
            for r in range(max(ROWS))
        ]
    )
    alone_f32 = torch.cat(
        [
            torch.ops.kiln.linear_q4(x_all[r : r + 1], q.qweight, q.scales, q.zeros, bias, group_size)
            for r in range(max(ROWS))
        ]
    )
    for rows in ROWS:
        x = x_all[:rows]
        want = reference(x, q, group_size, bias)
        for at_one_row in (False, True) if rows == 1 else (False,):  # one row: linear_q4's kernel or the panels
            torch.ops.kiln.q4_panels_at_one_row(at_one_row)
            got = torch.ops.kiln.linear_q4_panels(x, panels, q.qweight, q.scales, q.zeros, bias, group_size, half)
            assert got.shape == (rows, n)
            # the same integer sums; f32 arithmetic against float64
            assert torch.allclose(got.double(), want, atol=2e-4, rtol=1e-4), (rows, (got - want).abs().max())
            assert torch.equal(got, alone[:rows]), (rows, at_one_row, (got - alone[:rows]).abs().max())
        staged = torch.ops.kiln.linear_q4(x, q.qweight, q.scales, q.zeros, bias, group_size, half)
        assert torch.equal(staged, alone[:rows]), (rows, (staged - alone[:rows]).abs().max())
        staged_f32 = torch.ops.kiln.linear_q4(x, q.qweight, q.scales, q.zeros, bias, group_size)
        assert torch.equal(staged_f32, alone_f32[:rows]), (rows, (staged_f32 - alone_f32[:rows]).abs().max())
    torch.ops.kiln.q4_panels_at_one_row(False)


def test_packing_refuses_a_group_size_the_panels_cannot_hold(kernel):
    from kiln.backends.errors import LoweringError
    from kiln.backends.inductor.int4_kernel import pack_panels

    q = quantize_weight(torch.randn(16, 96), 4, 16, False)
    with pytest.raises(LoweringError, match="group_size % 32"):
        pack_panels(q.qweight, q.scales, q.zeros, 16)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-points"])
def test_the_lowering_runs_int4_linears_over_packed_panels(kernel, symmetric):
    """Inductor's lowering of an int4 linear_q packs the weight once and calls linear_q4_panels,
    equal to the interpreter to the kernel's rounding of x (as linear_q4 is held to)."""
    from kiln.backends.inductor import graph_to_fx
    from kiln.ir import run_graph
    from test_quantization import quantized_linear_graph

    graph = quantized_linear_graph(4, 32, symmetric, 192)
    module = graph_to_fx(graph)
    assert any("linear_q4_panels" in str(n.target) for n in module.graph.nodes)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 192)
        want, got = run_graph(graph, [x])[0], module(x)[0]
        assert ((got - want).norm() / want.norm()).item() < 0.012
