"""The IR: types, printer/parser round trip, verifier, interpreter."""

import pytest
import torch

from kiln.ir import (
    Graph,
    ParseError,
    TensorType,
    VerificationError,
    all_ops,
    parse_graph,
    print_graph,
    run_graph,
    symbol,
    verify,
)
from kiln.ir.graph import Value

B, S = symbol("batch"), symbol("seq")


def small_graph() -> Graph:
    g = Graph()
    g.add_symbol("batch", 1, 8)
    g.add_symbol("seq", 1, 64)
    g.meta = {"note": "test", "eps": 1e-6}
    tokens = g.add_input("tokens", TensorType("i64", (B, S)))
    emb = g.add_param("embed.weight", torch.randn(32, 8))
    norm_w = g.add_param("norm.weight", torch.randn(8))
    x = g.call("embedding", emb, tokens)
    x = g.call("rms_norm", x, norm_w, eps=1e-6)
    heads = g.call("reshape", x, shape=(B, S, 2, -1))
    halves = g.call("slice", heads, axis=-1, start=0, end=2)
    scaled = g.call("mul", halves, g.call("full", value=0.5))
    merged = g.call("reshape", scaled, shape=(B, S * 4))
    g.outputs = [g.call("concat", merged, merged, axis=-1, name="out")]
    return g


def test_types_print_symbolic_dims():
    assert str(TensorType("f32", (B, S + 1, 64))) == "f32[batch, seq+1, 64]"
    assert TensorType.parse("f32[batch, seq+1, 64]") == TensorType("f32", (B, S + 1, 64))


def test_shape_inference_resolves_reshape_minus_one():
    g = small_graph()
    reshape = next(n for n in g.nodes if n.op == "reshape")
    assert str(reshape.output.type) == "f32[batch, seq, 2, 4]"


def test_print_parse_round_trip_is_exact():
    g = small_graph()
    text = print_graph(g)
    again = parse_graph(text)
    assert print_graph(again) == text
    verify(again)


def test_parsed_graph_runs_like_the_original():
    g = small_graph()
    again = parse_graph(print_graph(g))
    again.weights = g.weights
    tokens = torch.randint(0, 32, (3, 5))
    torch.testing.assert_close(run_graph(g, [tokens])[0], run_graph(again, [tokens])[0])


def test_interpreter_matches_torch():
    g = small_graph()
    tokens = torch.randint(0, 32, (2, 7))
    x = torch.nn.functional.embedding(tokens, g.weights["embed.weight"])
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g.weights["norm.weight"]
    expected = (x.reshape(2, 7, 2, 4)[..., :2] * 0.5).reshape(2, 28)
    torch.testing.assert_close(run_graph(g, [tokens])[0], torch.cat([expected, expected], -1))


def test_interpreter_rejects_a_symbol_out_of_bounds():
    with pytest.raises(Exception, match="outside its bounds"):
        run_graph(small_graph(), [torch.zeros(9, 2, dtype=torch.long)])


def test_verifier_rejects_a_wrong_shape_naming_the_node():
    g = small_graph()
    node = next(n for n in g.nodes if n.op == "rms_norm")
    node.outputs[0].type = TensorType("f32", (B, S, 7))
    with pytest.raises(VerificationError, match=r"rms_norm.*typed f32\[batch, seq, 7\]"):
        verify(g)


def test_verifier_rejects_a_dangling_value_naming_the_node():
    g = small_graph()
    node = next(n for n in g.nodes if n.op == "slice")
    node.inputs[0] = Value("ghost", node.inputs[0].type)
    with pytest.raises(VerificationError, match=r"%ghost is not defined.*dangling"):
        verify(g)


def test_verifier_rejects_undeclared_symbols():
    g = small_graph()
    del g.symbols["seq"]
    with pytest.raises(VerificationError, match="undeclared symbols"):
        verify(g)


def test_parser_names_the_bad_line():
    text = print_graph(small_graph()).replace("embedding(", "embedding(%nowhere, ")
    with pytest.raises(ParseError, match="line .*nowhere"):
        parse_graph(text)


def test_every_op_has_a_type_rule_and_a_reference():
    for name, op in all_ops().items():
        assert callable(op.infer) and callable(op.reference), name


def test_attention_positions_mask_matches_causal_prefill():
    torch.manual_seed(0)
    g = Graph()
    g.add_symbol("seq", 1, 16)
    q = g.add_input("q", TensorType("f32", (1, 4, S, 8)))
    k = g.add_input("k", TensorType("f32", (1, 2, S, 8)))
    v = g.add_input("v", TensorType("f32", (1, 2, S, 8)))
    pos = g.add_input("pos", TensorType("i64", (1, S)))
    g.outputs = [g.call("attention", q, k, v, None, pos), g.call("attention", q, k, v, causal=True)]
    feeds = [torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.arange(6)[None]]
    by_position, causal = run_graph(g, feeds)
    expected = torch.nn.functional.scaled_dot_product_attention(
        feeds[0], feeds[1], feeds[2], is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(by_position, expected)
    torch.testing.assert_close(causal, expected)


def test_kv_write_writes_rows_at_their_own_positions():
    g = Graph()
    cache = g.add_input("cache", TensorType("f32", (2, 1, 6, 1)))
    new = g.add_input("new", TensorType("f32", (2, 1, 2, 1)))
    pos = g.add_input("pos", TensorType("i64", (2, 2)))
    g.outputs = [g.call("kv_write", cache, new, pos)]
    out = run_graph(
        g, [torch.zeros(2, 1, 6, 1), torch.tensor([1.0, 2, 3, 4]).reshape(2, 1, 2, 1), torch.tensor([[0, 1], [3, 4]])]
    )[0]
    assert out.flatten().tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 0, 3, 4, 0]
