"""Each automatic remedy, alone: the break is gone (Dynamo captures one graph with
`fullgraph=True`) and the output is what the code as written computes."""

from __future__ import annotations

import warnings

import pytest
import torch

import break_corpus
from kiln.frontend.branch_to_select import BranchSelectError, rewrite_branch, select_branch
from kiln.frontend.break_remedies import dynamo_config
from kiln.frontend.graph_breaks import SourceFrame


def one_graph(fn, config: dict | None = None):
    """`fn` compiled as a single graph (an error if Dynamo would break)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)

    def run(*args, **kwargs):
        with torch._dynamo.config.patch(config or {}):
            return compiled(*args, **kwargs)

    return run


def marked_line(class_name: str) -> SourceFrame:
    [(line, _)] = break_corpus.break_markers(class_name).items()
    return SourceFrame(break_corpus.__file__, line, "forward")


def test_as_written_the_corpus_models_do_not_compile_to_one_graph():
    module, (x,) = break_corpus.tensor_if()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        one_graph(module)(x)


@pytest.mark.parametrize("factory,class_name", [("tensor_if", "TensorIf"), ("tensor_if_return", "TensorIfReturn")])
def test_branch_to_select_removes_the_branch_and_keeps_both_arms_right(factory, class_name):
    module, (x,) = getattr(break_corpus, factory)()
    expected = {sign: module(sign * x) for sign in (1, -1)}
    assert (module.up(x).sum() > 0) != (module.up(-x).sum() > 0), "x and -x must take different arms"
    rewrite = rewrite_branch(module, marked_line(class_name))
    assert rewrite is not None and rewrite.instances == [module]
    compiled = one_graph(module)
    for sign in (1, -1):
        torch.testing.assert_close(compiled(sign * x), expected[sign], rtol=0, atol=0)
    rewrite.undo()
    assert "forward" not in module.__dict__


def test_branch_to_select_leaves_a_branch_with_side_effects_alone():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = []

        def forward(self, x):
            if x.sum() > 0:
                self.seen.append(1)
                y = x * 2
            else:
                y = x
            return y

    module = Counting()
    line = Counting.forward.__code__.co_firstlineno + 1
    assert rewrite_branch(module, SourceFrame(__file__, line, "forward")) is None


def test_select_branch_refuses_arms_of_different_shapes():
    with pytest.raises(BranchSelectError, match="same shape"):
        select_branch(torch.tensor(True), lambda: torch.ones(2), lambda: torch.ones(3))


def test_symbolic_scalars_capture_item_in_the_graph():
    module, (x,) = break_corpus.item_scalar()
    expected = module(x)
    torch.testing.assert_close(one_graph(module, dynamo_config({"symbolic_scalars"}))(x), expected)


def test_symbolic_shapes_capture_a_boolean_mask_in_the_graph():
    module, (x,) = break_corpus.masked_select()
    expected = module(x)
    torch.testing.assert_close(one_graph(module, dynamo_config({"symbolic_shapes"}))(x), expected)


def test_reorder_logging_keeps_the_warning_after_the_graph(recwarn):
    module, (x,) = break_corpus.warning_in_forward()
    expected = module(x)
    recwarn.clear()
    warnings.simplefilter("always")
    torch.testing.assert_close(one_graph(module, dynamo_config({"reorder_logging"}))(x), expected)
    assert any("corpus warning" in str(w.message) for w in recwarn)


@pytest.mark.parametrize("factory", ["print_in_forward", "logger_in_forward"])
def test_reorder_logging_drops_print_and_logger_calls_from_the_graph(factory, capsys):
    module, (x,) = getattr(break_corpus, factory)()
    expected = module(x)
    capsys.readouterr()
    torch.testing.assert_close(one_graph(module, dynamo_config({"reorder_logging"}))(x), expected)
    assert "hidden" not in capsys.readouterr().out


def test_stateless_capture_drops_the_cache_object_and_keeps_the_output():
    module, make_inputs = break_corpus.cache_object()
    with_cache = module(**make_inputs())
    with pytest.raises(torch._dynamo.exc.Unsupported):
        one_graph(module)(**make_inputs())
    stateless = {**make_inputs(), "use_cache": False}
    del stateless["past_key_values"]
    torch.testing.assert_close(one_graph(module)(**stateless), with_cache)
