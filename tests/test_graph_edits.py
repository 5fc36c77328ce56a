"""The Graph's edits keep `users` current and refuse what would break the graph; op traits."""

import pytest

from kiln.ir import Graph, GraphEditError, OpError, TensorType, ops_with, print_graph, verify
from kiln.ir.registry import OpDef

X = TensorType("f32", (2, 3))


def graph_with_chain():
    """x -> exp -> neg -> output %out; returns (graph, x, exp node, neg node)."""
    graph = Graph()
    x = graph.add_input("x", X)
    e = graph.call("exp", x)
    graph.outputs = [graph.call("neg", e, name="out")]
    return graph, x, e.producer, graph.outputs[0].producer


def users_from_scratch(graph: Graph) -> dict[str, list[int]]:
    """What `users` must be: per value name, the ids of the nodes reading it, one per read."""
    expected: dict[str, list[int]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None:
                expected.setdefault(v.name, []).append(id(node))
    return expected


def kept_users(graph: Graph) -> dict[str, list[int]]:
    return {v.name: sorted(id(u) for u in v.users) for v in graph.values() if v.users}


def assert_users_current(graph: Graph) -> None:
    assert kept_users(graph) == {k: sorted(v) for k, v in users_from_scratch(graph).items()}


def test_users_follow_appends_reads_twice_and_outputs_are_not_users():
    graph, x, exp, neg = graph_with_chain()
    square = graph.call("mul", neg.output, neg.output)
    assert x.users == [exp] and exp.output.users == [neg]
    assert neg.output.users == [square.producer, square.producer] and square.users == []
    assert_users_current(graph)


def test_insert_before_and_after_place_nodes_and_record_their_reads():
    graph, x, exp, neg = graph_with_chain()
    before = graph.create("abs", [x])
    after = graph.create("sigmoid", [exp.output])
    graph.insert_before(exp, before)
    graph.insert_after(exp, after)
    assert [n.op for n in graph.nodes] == ["abs", "exp", "sigmoid", "neg"]
    assert [graph.position(n) for n in graph.nodes] == [0, 1, 2, 3]
    assert exp.output.users == [neg, after]
    assert_users_current(graph)


def test_a_node_cannot_be_placed_twice_or_next_to_a_stranger():
    graph, x, exp, _ = graph_with_chain()
    with pytest.raises(GraphEditError, match="twice"):
        graph.insert_before(exp, exp)
    stranger = graph.create("abs", [x])
    with pytest.raises(GraphEditError, match="not in the graph"):
        graph.insert_after(stranger, graph.create("exp", [x]))
    assert_users_current(graph)


def test_replace_all_uses_moves_reads_and_keeps_the_output_name():
    graph, _, exp, neg = graph_with_chain()
    cheaper = graph.create("abs", [exp.output])
    graph.insert_after(neg, cheaper)
    graph.replace_all_uses(neg.output, cheaper.output)
    assert graph.outputs == [cheaper.output] and cheaper.output.name == "out"
    assert neg.output.users == [] and exp.output.users == [neg, cheaper]
    graph.erase(neg)
    verify(graph)
    assert [n.op for n in graph.nodes] == ["exp", "abs"]
    assert_users_current(graph)


def test_erase_refuses_a_node_still_read_or_an_output():
    graph, x, exp, neg = graph_with_chain()
    with pytest.raises(GraphEditError, match=r"still read by `.*neg.*`.*Fix: replace its uses"):
        graph.erase(exp)
    with pytest.raises(GraphEditError, match="graph output"):
        graph.erase(neg)
    graph.outputs = [x]
    graph.erase(exp, neg)  # read only by each other: erased together
    assert graph.nodes == [] and x.users == []
    graph.call("exp", x, name="out")  # the erased names are free again


def test_set_input_moves_one_read():
    graph, x, exp, neg = graph_with_chain()
    graph.set_input(neg, 0, x)
    assert x.users == [exp, neg] and exp.output.users == []
    assert_users_current(graph)


def test_rename_claims_the_new_name_and_releases_the_old():
    graph, x, exp, _ = graph_with_chain()
    old = exp.output.name
    graph.rename(exp.output, "e")
    with pytest.raises(GraphEditError, match="name is taken"):
        graph.rename(x, "e")
    assert graph.call("abs", x, name=old).name == old
    assert "%e" in print_graph(graph)


def test_raw_list_edits_of_nodes_keep_users_current():
    graph, _, exp, _ = graph_with_chain()
    extra = graph.create("abs", [exp.output])
    graph.nodes.append(extra)
    graph.nodes.pop(0)
    graph.nodes.insert(0, exp)
    graph.nodes[2:3] = []
    assert_users_current(graph)
    graph.nodes = list(graph.nodes)[::-1]
    assert_users_current(graph)


def test_traits_name_the_ops_that_have_them():
    assert {"add", "exp", "where", "cast", "gelu"} <= ops_with("elementwise")
    assert not {"matmul", "softmax", "reshape", "linear"} & ops_with("elementwise")
    assert {"add", "mul", "maximum"} <= ops_with("commutative") and "sub" not in ops_with("commutative")
    assert ops_with("constant") == {"full", "arange"}


def test_an_unknown_trait_is_refused_with_the_known_ones():
    with pytest.raises(OpError, match="unknown op trait 'elementwize'.*'elementwise'"):
        ops_with("elementwize")
    with pytest.raises(OpError, match="unknown op trait"):
        OpDef("twice", ("x",), lambda x: x, lambda x: 2 * x, traits={"linear-ish"})
