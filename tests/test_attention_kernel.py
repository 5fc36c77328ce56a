"""Attention over a static KV cache lowered to Kiln's kernel (backends/inductor/fast_attention.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.backends.inductor import composite_ops, fast_attention, graph_to_fx
from kiln.ir import Graph, TensorType, run_graph
from kiln.ir.ops.attention import attention_reference

pytestmark = pytest.mark.skipif(
    not fast_attention.kernel_available(), reason="the attention kernel cannot be built here"
)


def cached_attention(q, k, v, positions, window=0):
    return torch.ops.kiln.cached_attention(q, k, v, positions, 1 / math.sqrt(q.size(-1)), window)


def positions_for(batch: int, seq: int, slots: int, generator: torch.Generator) -> torch.Tensor:
    """Contiguous positions per row, each row at its own offset (row 1 from slot 0)."""
    starts = torch.randint(0, slots - seq + 1, (batch,), generator=generator)
    if batch > 1:
        starts[1] = 0
    return starts[:, None] + torch.arange(seq)


@pytest.mark.parametrize(
    "batch,heads,kv_heads,seq,head_dim,window",
    [
        (1, 9, 3, 1, 64, 0),  # SmolLM2 decode
        (2, 4, 2, 3, 20, 0),  # a few queries (speculative verification), head dim not a multiple of 8
        (3, 8, 2, 8, 64, 7),  # sliding window, the most queries the kernel takes
        (2, 6, 3, 24, 32, 0),  # a prefill chunk: ATen's attention over the used slots
        (2, 4, 4, 16, 16, 5),  # prefill with a window, no grouping
    ],
)
def test_the_kernel_matches_the_irs_attention(batch, heads, kv_heads, seq, head_dim, window):
    generator = torch.Generator().manual_seed(seq * 31 + heads)
    slots = 48
    q = torch.randn(batch, heads, seq, head_dim, generator=generator)
    k, v = (torch.randn(batch + 1, kv_heads, slots, head_dim, generator=generator) for _ in range(2))
    positions = positions_for(batch, seq, slots, generator)
    expected = attention_reference(q, k, v, None, positions, None, scale=None, causal=False, window=window, softcap=0.0)
    torch.testing.assert_close(cached_attention(q, k, v, positions, window), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("int8,window", [(False, 0), (False, 90), (True, 0), (True, 90)])
def test_queries_of_a_group_across_slot_blocks_match_the_irs_attention(int8, window):
    """16 tokens x 3 heads per kv head over 200 slots: the kernel attends them together, 64 slots a
    block; each token sees its own span (window, tree) across the blocks."""
    from kiln.ir.ops.kv_quant import kv_quantize_reference

    generator = torch.Generator().manual_seed(200 + window)
    batch, heads, kv_heads, seq, head_dim, slots = 2, 6, 2, 16, 64, 200
    q = torch.randn(batch, heads, seq, head_dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, slots, head_dim, generator=generator) for _ in range(2))
    scales = [None, None]
    if int8:
        (k, scales[0]), (v, scales[1]) = kv_quantize_reference(k), kv_quantize_reference(v)
    positions = torch.tensor([[150], [40]]) + torch.arange(seq)
    tree = (torch.rand(batch, seq, seq, generator=generator).tril() > 0.5) | torch.eye(seq, dtype=torch.bool)
    expected = attention_reference(
        q, k, v, None, positions, tree, *scales, scale=None, causal=False, window=window, softcap=0.0
    )
    scale = 1 / math.sqrt(head_dim)
    actual = torch.ops.kiln.cached_attention(q, k, v, positions, scale, window, tree, *scales)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_rows_at_far_apart_positions_get_their_bits_alone():
    """A batched decode's rows sit at different positions, and the threads split the rows by the
    slots they read: each row's output equals its output alone, bit for bit, and the reference."""
    generator = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, head_dim, slots = 8, 9, 3, 64, 300
    q = torch.randn(batch, heads, 1, head_dim, generator=generator)
    k, v = (torch.randn(batch, kv_heads, slots, head_dim, generator=generator) for _ in range(2))
    positions = torch.tensor([[3], [290], [10], [7], [250], [0], [140], [299]])
    together = cached_attention(q, k, v, positions)
    for row in range(batch):
        alone = cached_attention(q[row : row + 1], k[row : row + 1], v[row : row + 1], positions[row : row + 1])
        assert torch.equal(together[row], alone[0]), row
    expected = attention_reference(q, k, v, None, positions, None, scale=None, causal=False, window=0, softcap=0.0)
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)


def test_a_tree_node_gets_the_bits_of_the_one_token_call_on_its_chain():
    """A node sees its ancestors through slots its siblings interleave: its output equals, bit for
    bit, a one-token call with those ancestors in consecutive slots (greedy speculative trees then
    decode as plain decoding does, even where int8 activations would amplify a rounding)."""
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, fed = 6, 2, 64, 150
    parents = [-1, -1, *range(10)]  # two interleaved branches: even nodes and odd nodes
    q = torch.randn(1, heads, len(parents), head_dim, generator=generator)
    k, v = (torch.randn(1, kv_heads, fed + len(parents), head_dim, generator=generator) for _ in range(2))
    tree = torch.eye(len(parents), dtype=torch.bool)
    for node, parent in enumerate(parents):
        while parent >= 0:
            tree[node, parent], parent = True, parents[parent]
    scale = 1 / math.sqrt(head_dim)
    slots = torch.arange(fed, fed + len(parents))[None]
    together = torch.ops.kiln.cached_attention(q, k, v, slots, scale, 0, tree[None])
    for node in range(len(parents)):
        kept = list(range(fed)) + [fed + other for other in range(node % 2, node + 1, 2)]
        position = torch.tensor([[len(kept) - 1]])
        alone = torch.ops.kiln.cached_attention(
            q[:, :, node : node + 1], k[:, :, kept], v[:, :, kept], position, scale, 0
        )
        assert torch.equal(together[:, :, node], alone[:, :, 0]), node


def test_slots_past_the_position_are_never_read():
    """NaN in the slots a query cannot see (stale rows of the buffer) stays out of the output."""
    q = torch.randn(1, 4, 2, 16)
    k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    positions = torch.tensor([[5, 6]])
    k[:, :, 7:], v[:, :, 7:] = float("nan"), float("nan")
    assert torch.isfinite(cached_attention(q, k, v, positions)).all()


def test_bad_shapes_are_errors_that_name_the_problem():
    q, cache = torch.randn(1, 6, 1, 16), torch.randn(1, 4, 8, 16)
    with pytest.raises(RuntimeError, match="not a multiple of 4 kv heads"):
        cached_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="positions must be int64"):
        cached_attention(torch.randn(1, 4, 1, 16), cache, cache, torch.zeros(1, 2, dtype=torch.long))


def attention_graph(window: int = 0, softcap: float = 0.0) -> Graph:
    g = Graph()
    q = g.add_input("q", TensorType("f32", (2, 6, 3, 16)))
    k = g.add_input("k", TensorType("f32", (2, 2, 24, 16)))
    v = g.add_input("v", TensorType("f32", (2, 2, 24, 16)))
    positions = g.add_input("positions", TensorType("i64", (2, 3)))
    g.outputs = [g.call("attention", q, k, v, None, positions, window=window, softcap=softcap)]
    return g


def called_functions(module) -> set:
    return {n.target for n in module.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("window", [0, 4])
def test_stateful_attention_lowers_to_the_kernel_and_matches_the_interpreter(window):
    graph = attention_graph(window)
    module = graph_to_fx(graph)
    assert torch.ops.kiln.cached_attention in called_functions(module)
    generator = torch.Generator().manual_seed(window)
    feeds = [
        torch.randn(2, 6, 3, 16, generator=generator),
        torch.randn(2, 2, 24, 16, generator=generator),
        torch.randn(2, 2, 24, 16, generator=generator),
        torch.tensor([[4, 5, 6], [20, 21, 22]]),
    ]
    torch.testing.assert_close(module(*feeds)[0], run_graph(graph, feeds)[0], atol=1e-5, rtol=1e-5)


def test_softcap_and_the_environment_switch_keep_the_composite_attention(monkeypatch):
    assert composite_ops.attention in called_functions(graph_to_fx(attention_graph(softcap=30.0)))
    monkeypatch.setenv(fast_attention.ENV_SWITCH, "torch")
    assert composite_ops.attention in called_functions(graph_to_fx(attention_graph()))
    monkeypatch.setenv(fast_attention.ENV_SWITCH, "fastest")
    with pytest.raises(ValueError, match="KILN_ATTENTION_KERNEL"):
        graph_to_fx(attention_graph())
