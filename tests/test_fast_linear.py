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


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)], ids=["wide (kn)", "narrow (nk)"])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_linears_call_the_kernel_and_match_the_interpreter(shape, bias):
    graph = linear_graph(*shape, bias)
    module = graph_to_fx(graph)
    assert torch.ops.kiln.linear_f32 in called_functions(module)
    assert "param_w" not in dict(module.named_parameters())  # only the packed copy is kept
    for rows in (1, 3, 40):  # the GEMV path (<= 8 rows) and the GEMM path
        x = torch.randn(rows, shape[1])
        torch.testing.assert_close(module(x)[0], run_graph(graph, [x])[0], atol=1e-4, rtol=1e-4)


def test_the_environment_switch_keeps_torch_linear(monkeypatch):
    monkeypatch.setenv(fast_linear.ENV_SWITCH, "torch")
    assert F.linear in called_functions(graph_to_fx(linear_graph(8, 4, True)))
    monkeypatch.setenv(fast_linear.ENV_SWITCH, "fastest")
    with pytest.raises(ValueError, match="KILN_LINEAR_KERNEL"):
        graph_to_fx(linear_graph(8, 4, True))


def test_non_parameter_and_non_fp32_weights_are_left_to_torch():
    g = Graph()
    x = g.add_input("x", TensorType("f32", (2, 4)))
    w = g.add_input("w", TensorType("f32", (3, 4)))  # a weight computed at run time, not a parameter
    g.outputs = [g.call("linear", x, w, None)]
    assert F.linear in called_functions(graph_to_fx(g))
