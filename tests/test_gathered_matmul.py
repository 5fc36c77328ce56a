"""Mixture-of-experts products: `gathered_matmul` (each routed row's expert matrix applied where
it lies) against its reference, and the fusion that finds it in a captured MoE model."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.inductor import gathered_matmul
from kiln.ir.ops.routing import _gathered_matmul_reference


@pytest.mark.parametrize("ids", [[3], [1, 1], [0, 2, 2, 0, 1, 3, 3, 3], list(range(4)) * 5])
def test_the_op_equals_the_gathered_product(ids):
    gathered_matmul.ensure_loaded()
    generator = torch.Generator().manual_seed(len(ids))
    weights = torch.randn(4, 24, 16, generator=generator)
    x = torch.randn(len(ids), 16, 3, generator=generator)
    index = torch.tensor(ids)
    want = _gathered_matmul_reference(weights, index, x)
    torch.testing.assert_close(torch.ops.kiln.gathered_matmul(weights, index, x), want, atol=1e-5, rtol=1e-5)
    packed = weights.transpose(1, 2).contiguous()  # as the lowering packs experts for the GEMV kernel
    torch.testing.assert_close(torch.ops.kiln.gathered_linear(packed, index, x), want, atol=1e-5, rtol=1e-5)


def test_an_expert_id_out_of_range_is_refused():
    gathered_matmul.ensure_loaded()
    with pytest.raises(RuntimeError, match="expert id 4 is not in"):
        torch.ops.kiln.gathered_matmul(torch.zeros(4, 2, 2), torch.tensor([4]), torch.zeros(1, 2, 1))
    with pytest.raises(RuntimeError, match="expert id -1 is not in"):
        torch.ops.kiln.gathered_linear(torch.zeros(4, 2, 2), torch.tensor([-1]), torch.zeros(1, 2, 1))


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_captured_experts_are_multiplied_in_place(tiny_model_dirs, family):
    from kiln.ir_listing import load_graph

    graph = load_graph(str(tiny_model_dirs(family)), True, 1, 64)
    experts = [n for n in graph.nodes if n.op == "gathered_matmul"]
    assert len(experts) == 2 * graph.meta["kv_cache"]["layers"]  # gate/up and down per layer
    assert not any(n.op == "index" and n.inputs[0].name in graph.params for n in graph.nodes)
