"""The pass manager and the generic passes: each rewrites its pattern and keeps the results."""

from __future__ import annotations

import pytest
import torch

from kiln.ir import Graph, TensorType, parse_graph, print_graph, run_graph, symbol, verify
from kiln.passes import (
    Pass,
    PassError,
    PassManager,
    canonicalize,
    default_pipeline,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fold_constants,
)

BATCH = symbol("batch")


def new_graph() -> tuple[Graph, object]:
    """A graph with one input %x: f32[batch, 4, 6]."""
    graph = Graph()
    graph.add_symbol("batch", 1, 8)
    return graph, graph.add_input("x", TensorType("f32", (BATCH, 4, 6)))


def sample_feeds() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0))}


def ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


def apply_and_compare(transform, graph: Graph) -> Graph:
    """Run `transform`, verify the result and check the interpreter gives the same outputs."""
    before = run_graph(graph, sample_feeds())
    graph = transform(graph)
    verify(graph)
    after = run_graph(graph, sample_feeds())
    assert len(after) == len(before)
    for want, got in zip(before, after):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    return graph


def messy_graph() -> Graph:
    """No-ops, a foldable constant, dead code and a repeated node around one linear."""
    graph, x = new_graph()
    w = graph.add_param("w", torch.randn(6, 6, generator=torch.Generator().manual_seed(1)))
    graph.add_param("unused", torch.zeros(2))
    r = graph.call("reshape", x, shape=(BATCH, 4, 6))
    p = graph.call("permute", graph.call("permute", r, perm=(0, 2, 1)), perm=(0, 2, 1))
    c = graph.call("add", graph.call("full", shape=(6,), value=2.0), graph.call("full", shape=(6,), value=3.0))
    z = graph.call("mul", graph.call("linear", p, w), c)
    graph.call("exp", x)
    graph.outputs = [graph.call("add", graph.call("relu", z), graph.call("relu", z), name="out")]
    return graph


# -- dead-code elimination ------------------------------------------------------------------
def test_dce_removes_unused_nodes_params_and_weights():
    graph, x = new_graph()
    w = graph.add_param("w", torch.randn(6, 6))
    graph.call("linear", x, w)
    graph.outputs = [graph.call("relu", x)]
    graph = apply_and_compare(eliminate_dead_code, graph)
    assert ops(graph) == ["relu"]
    assert graph.params == {} and graph.weights == {}
    assert [v.name for v in graph.inputs] == ["x"]


# -- common-subexpression elimination -------------------------------------------------------
def test_cse_merges_repeated_nodes_and_their_users():
    graph, x = new_graph()
    a, b = graph.call("exp", x), graph.call("exp", x)
    graph.outputs = [graph.call("add", graph.call("relu", a), graph.call("relu", b))]
    graph = apply_and_compare(eliminate_common_subexpressions, graph)
    assert ops(graph) == ["exp", "relu", "add"]


def test_cse_keeps_nodes_with_different_attributes():
    graph, x = new_graph()
    graph.outputs = [graph.call("sum", x, axes=(1,)), graph.call("sum", x, axes=(2,))]
    graph = apply_and_compare(eliminate_common_subexpressions, graph)
    assert ops(graph) == ["sum", "sum"]


# -- canonicalize ---------------------------------------------------------------------------
def test_canonicalize_removes_noop_shape_ops_and_casts():
    graph, x = new_graph()
    y = graph.call("reshape", x, shape=(BATCH, 4, 6))
    y = graph.call("permute", y, perm=(0, 1, 2))
    y = graph.call("expand", y, shape=(-1, 4, 6))
    y = graph.call("slice", y, axis=2, start=0, end=6)
    y = graph.call("cast", y, dtype="f32")
    graph.outputs = [graph.call("exp", y)]
    graph = apply_and_compare(canonicalize, graph)
    assert ops(graph) == ["exp"]


def test_canonicalize_keeps_shape_ops_that_do_work():
    graph, x = new_graph()
    y = graph.call("slice", x, axis=2, start=0, end=5)
    y = graph.call("permute", y, perm=(0, 2, 1))
    graph.outputs = [graph.call("cast", y, dtype="f64")]
    graph = apply_and_compare(canonicalize, graph)
    assert ops(graph) == ["slice", "permute", "cast"]


def test_canonicalize_collapses_reshape_chains():
    graph, x = new_graph()
    flat = graph.call("reshape", x, shape=(BATCH, 24))
    graph.outputs = [graph.call("reshape", flat, shape=(BATCH, 6, 4))]
    graph = apply_and_compare(lambda g: eliminate_dead_code(canonicalize(g)), graph)
    assert ops(graph) == ["reshape"] and graph.nodes[0].inputs[0] is x


def test_canonicalize_composes_permute_chains():
    graph, x = new_graph()
    y = graph.call("permute", graph.call("permute", x, perm=(0, 2, 1)), perm=(2, 0, 1))
    graph.outputs = [y]
    graph = apply_and_compare(lambda g: eliminate_dead_code(canonicalize(g)), graph)
    assert ops(graph) == ["permute"] and graph.nodes[0].inputs[0] is x


def test_canonicalize_removes_permutes_that_cancel():
    graph, x = new_graph()
    y = graph.call("permute", graph.call("permute", x, perm=(0, 2, 1)), perm=(0, 2, 1))
    graph.outputs = [graph.call("exp", y)]
    graph = apply_and_compare(lambda g: eliminate_dead_code(canonicalize(g)), graph)
    assert ops(graph) == ["exp"]


def test_canonicalize_removes_neutral_arithmetic():
    graph, x = new_graph()
    one, zero = graph.call("full", value=1.0), graph.call("full", value=0.0)
    y = graph.call("div", graph.call("mul", one, x), one)
    graph.outputs = [graph.call("add", zero, y)]
    graph = apply_and_compare(lambda g: eliminate_dead_code(canonicalize(g)), graph)
    assert ops(graph) == [] and graph.outputs[0] is x


def test_canonicalize_keeps_arithmetic_that_broadcasts_or_scales():
    graph, x = new_graph()
    zeros = graph.call("full", shape=(2, 1, 4, 6), value=0.0)
    y = graph.call("mul", x, graph.call("full", value=2.0))
    graph.outputs = [graph.call("add", y, zeros)]
    graph = apply_and_compare(canonicalize, graph)
    assert ops(graph).count("mul") == 1 and ops(graph).count("add") == 1


def test_canonicalize_keeps_the_graph_output_name():
    graph, x = new_graph()
    y = graph.call("exp", x)
    graph.outputs = [graph.call("reshape", y, shape=(BATCH, 4, 6), name="logits")]
    graph = apply_and_compare(canonicalize, graph)
    assert ops(graph) == ["exp"] and graph.outputs[0].name == "logits"
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)


# -- constant folding -----------------------------------------------------------------------
def test_constant_fold_turns_uniform_constant_expressions_into_full():
    graph, x = new_graph()
    two, three = graph.call("full", shape=(4, 6), value=2.0), graph.call("full", shape=(4, 6), value=3.0)
    graph.outputs = [graph.call("mul", x, graph.call("exp", graph.call("add", two, three)))]
    graph = apply_and_compare(lambda g: eliminate_dead_code(fold_constants(g)), graph)
    assert ops(graph) == ["full", "mul"]
    assert graph.nodes[0].attrs["value"] == pytest.approx(torch.exp(torch.tensor(5.0)).item())


def test_constant_fold_goes_through_non_uniform_constants():
    graph, x = new_graph()
    same = graph.call("eq", graph.call("arange", end=6), graph.call("arange", end=6))
    graph.outputs = [graph.call("where", same, x, graph.call("full", value=0.0))]
    graph = apply_and_compare(lambda g: eliminate_dead_code(fold_constants(g)), graph)
    assert ops(graph) == ["full", "full", "where"]


def test_constant_fold_leaves_non_uniform_constants():
    graph, x = new_graph()
    ramp = graph.call("cast", graph.call("arange", end=6), dtype="f32")
    graph.outputs = [graph.call("add", x, ramp)]
    graph = apply_and_compare(fold_constants, graph)
    assert ops(graph) == ["arange", "cast", "add"]


def test_constant_fold_skips_params_symbolic_and_large_shapes():
    graph, x = new_graph()
    w = graph.add_param("w", torch.ones(6))
    scaled = graph.call("mul", w, graph.call("full", value=2.0))
    per_row = graph.call("exp", graph.call("full", shape=(BATCH, 1, 1), value=1.0))
    big = graph.call("exp", graph.call("full", shape=(4096, 2), value=1.0))
    graph.outputs = [graph.call("mul", graph.call("add", x, scaled), per_row), big]
    graph = apply_and_compare(fold_constants, graph)
    assert ops(graph).count("exp") == 2 and ops(graph).count("mul") == 2


# -- the pass manager -----------------------------------------------------------------------
def test_manager_runs_phases_in_order_and_reports_node_counts():
    seen = []
    manager = PassManager(
        [("clean", [Pass("dce", eliminate_dead_code)]), ("merge", [Pass("cse", eliminate_common_subexpressions)])],
        progress=seen.append,
    )
    manager.run(messy_graph())
    assert [(r.phase, r.name) for r in manager.report] == [("clean", "dce"), ("merge", "cse")]
    assert (manager.report[0].nodes_before, manager.report[0].nodes_after) == (12, 11)
    assert manager.report[1].nodes_after == 10 and seen == manager.report


def test_manager_names_the_pass_that_breaks_the_graph():
    def drop_first_node(graph):
        graph.nodes.pop(0)
        return graph

    manager = PassManager(
        [("canonicalize", [Pass("dce", eliminate_dead_code), Pass("drop_first_node", drop_first_node)])]
    )
    with pytest.raises(PassError, match=r"pass 'drop_first_node'.*dangling"):
        manager.run(messy_graph())


def test_manager_rejects_a_pass_that_returns_nothing():
    manager = PassManager([("p", [Pass("forgetful", lambda graph: None)])])
    with pytest.raises(PassError, match="'forgetful'.*NoneType"):
        manager.run(messy_graph())


def test_interpreter_check_names_a_pass_that_changes_results():
    def relu_to_exp(graph):
        for node in graph.nodes:
            if node.op == "relu":
                node.op = "exp"
        return graph

    manager = PassManager([("p", [Pass("relu_to_exp", relu_to_exp)])]).check_with_interpreter(sample_feeds())
    with pytest.raises(PassError, match="'relu_to_exp' .*changed the graph's results"):
        manager.run(messy_graph())


def test_interpreter_check_lets_a_signature_changing_pass_through():
    def add_state(graph):  # like KV-cache insertion: a new static input passed through to an output
        state = graph.add_input("state", TensorType("f32", (2, 3)))
        graph.outputs.append(graph.call("exp", state))
        return graph

    manager = PassManager(
        [
            ("state", [Pass("add_state", add_state, preserves_signature=False)]),
            ("cleanup", [Pass("dce", eliminate_dead_code)]),
        ]
    )
    graph = manager.check_with_interpreter(sample_feeds()).run(messy_graph())
    assert [v.name for v in graph.inputs] == ["x", "state"] and len(graph.outputs) == 2


def test_default_pipeline_without_kv_cache_keeps_results_and_cleans_up():
    options = type("Options", (), {"max_batch": 2, "max_seq_len": 16})()
    phases = default_pipeline(options).phases
    assert [name for name, _ in phases] == ["canonicalize", "fuse", "quantize", "kv_cache", "cleanup"]
    manager = PassManager([p for p in phases if p[0] != "kv_cache"]).check_with_interpreter(sample_feeds())
    graph = manager.run(messy_graph())
    assert ops(graph) == ["full", "linear", "mul", "relu", "add"]
    assert list(graph.params) == ["w"] and graph.outputs[0].name == "out"


def test_dump_dir_writes_one_parsable_file_per_phase(tmp_path):
    phases = [
        ("canonicalize", [Pass("canonicalize", canonicalize), Pass("dce", eliminate_dead_code)]),
        ("fuse", []),
        ("cleanup", [Pass("cse", eliminate_common_subexpressions)]),
    ]
    PassManager(phases, dump_dir=tmp_path / "ir").run(messy_graph())
    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == ["00-captured.kir", "01-canonicalize.kir", "02-fuse.kir", "03-cleanup.kir"]
    for name in files:
        text = (tmp_path / "ir" / name).read_text()
        assert print_graph(parse_graph(text)) == text


class LearnedBiasAttention(torch.nn.Module):
    """One attention layer whose float mask is a learned bias, not a mask of the positions."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)
        self.bias = torch.nn.Parameter(torch.randn(1, 1, 16, 16))

    def forward(self, tokens, positions):
        x = self.embed(tokens)[:, None]
        seq = tokens.shape[1]
        attended = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=self.bias[..., :seq, :seq])
        return self.head(attended[:, 0])


def test_a_float_mask_that_is_not_a_position_mask_is_an_error_naming_its_line():
    from kiln.frontend.capture import capture_module
    from kiln.passes.insert_kv_cache import UnsupportedMaskError, insert_kv_cache

    dims = {(0, 0): ("batch", 1, 4), (0, 1): ("seq", 1, 8), (1, 0): ("batch", 1, 4), (1, 1): ("seq", 1, 8)}
    feeds = (torch.randint(0, 16, (2, 5)), torch.arange(5).expand(2, 5))
    graph = capture_module(LearnedBiasAttention(), feeds, ["tokens", "positions"], ["logits"], dims)
    with pytest.raises(UnsupportedMaskError, match=r"layer 0 takes a f32 mask .* at .*test_passes.py:\d+.*%bias") as e:
        insert_kv_cache(graph, max_batch=2, max_seq_len=8)
    assert "Fix:" in str(e.value)


class PaddingMaskAttention(LearnedBiasAttention):
    """A boolean mask computed from the tokens (keys of token 0 hidden, as a padding mask)."""

    def forward(self, tokens, positions):
        x = self.embed(tokens)[:, None]
        keep = (tokens != 0)[:, None, None, :]
        attended = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=keep)
        return self.head(attended[:, 0])


def test_a_boolean_mask_computed_from_the_tokens_is_an_error_not_dropped():
    from kiln.frontend.capture import capture_module
    from kiln.passes.insert_kv_cache import UnsupportedMaskError, insert_kv_cache

    dims = {(0, 0): ("batch", 1, 4), (0, 1): ("seq", 1, 8), (1, 0): ("batch", 1, 4), (1, 1): ("seq", 1, 8)}
    feeds = (torch.randint(1, 16, (2, 5)), torch.arange(5).expand(2, 5))
    graph = capture_module(PaddingMaskAttention(), feeds, ["tokens", "positions"], ["logits"], dims)
    with pytest.raises(UnsupportedMaskError, match=r"layer 0 takes a bool mask .*computed from %tokens"):
        insert_kv_cache(graph, max_batch=2, max_seq_len=8)
