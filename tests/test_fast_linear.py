"""fp32 linears lowered to Kiln's GEMV kernel (backends/inductor/fast_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.backends.inductor import fast_linear, graph_to_fx
from kiln.ir import Graph, TensorType, run_graph, symbol

pytestmark = pytest.mark.skipif(not fast_linear.kernel_available(), reason="the GEMV kernel cannot be built here")


def linear_graph(out_features: int, in_features: int, bias: bool) -> Graph:
    g = Graph()
    g.add_symbol("rows", 1, 64)
    x = g.add_input("x", TensorType("f32", (symbol("rows"), in_features)))
    b = g.add_param("b", torch.randn(out_features)) if bias else None
    g.outputs = [g.call("linear", x, g.add_param("w", torch.randn(out_features, in_features)), b)]
    return g


def called_functions(module) -> set:
    return {n.target for n in module.graph.nodes if n.op == "call_function"}


LAYOUT_OPS = {"panels": "linear_f32_panels", "slabs": "linear_f32"}


@pytest.mark.parametrize("layout", ["panels", "slabs"])
@pytest.mark.parametrize("shape", [(96, 32), (32, 96), (200, 40)], ids=["wide", "narrow", "panel tail"])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_linears_call_the_kernel_and_match_the_interpreter(shape, bias, layout, monkeypatch):
    monkeypatch.setenv(fast_linear.LAYOUT_SWITCH, layout)
    graph = linear_graph(*shape, bias)
    module = graph_to_fx(graph)
    assert getattr(torch.ops.kiln, LAYOUT_OPS[layout]) in called_functions(module)
    assert fast_linear.f32_layout_of(module) == layout
    assert "param_w" not in dict(module.named_parameters())  # only the packed copy is kept
    for rows in (1, 3, 40):  # one row, a few, many
        x = torch.randn(rows, shape[1])
        torch.testing.assert_close(module(x)[0], run_graph(graph, [x])[0], atol=1e-4, rtol=1e-4)


def test_the_environment_switch_keeps_torch_linear(monkeypatch):
    monkeypatch.setenv(fast_linear.ENV_SWITCH, "torch")
    assert F.linear in called_functions(graph_to_fx(linear_graph(8, 4, True)))
    monkeypatch.setenv(fast_linear.ENV_SWITCH, "fastest")
    with pytest.raises(ValueError, match="KILN_LINEAR_KERNEL"):
        graph_to_fx(linear_graph(8, 4, True))


def test_a_package_lowers_in_the_layout_it_was_compiled_with(monkeypatch):
    monkeypatch.setenv(fast_linear.LAYOUT_SWITCH, "panels")
    with fast_linear.lowering_f32_as("slabs"):  # an artifact compiled before the panels
        assert fast_linear.f32_layout_of(graph_to_fx(linear_graph(8, 4, True))) == "slabs"
    monkeypatch.setenv(fast_linear.LAYOUT_SWITCH, "rows")
    with pytest.raises(ValueError, match="KILN_LINEAR_LAYOUT=.rows. is not a choice"):
        graph_to_fx(linear_graph(8, 4, True))


def test_non_parameter_and_non_fp32_weights_are_left_to_torch():
    g = Graph()
    x = g.add_input("x", TensorType("f32", (2, 4)))
    w = g.add_input("w", TensorType("f32", (3, 4)))  # a weight computed at run time, not a parameter
    g.outputs = [g.call("linear", x, w, None)]
    assert F.linear in called_functions(graph_to_fx(g))
