"""Capture: every architecture's IR computes Hugging Face's logits; unmapped ops are reported."""

import pytest
import torch

from kiln.frontend.capture import capture_causal_lm, capture_module
from kiln.frontend.checkpoint import load_model
from kiln.frontend.errors import UnsupportedOpError
from kiln.ir import parse_graph, print_graph, run_graph, verify
from tiny_models import ARCHITECTURES, VOCAB_SIZE, save_tiny_checkpoint


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """arch -> (HF model, captured graph), built once per module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model = load_model(save_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch))).model
            cache[arch] = model, capture_causal_lm(model, max_batch=4, max_seq_len=64)
        return cache[arch]

    return get


def hf_logits(model, tokens, positions):
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=positions, use_cache=False).logits


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_interpreted_ir_matches_hugging_face_logits(captured, arch):
    model, graph = captured(arch)
    verify(graph)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB_SIZE, (2, 17))
    positions = torch.arange(17).expand(2, 17)
    logits = run_graph(graph, [tokens, positions])[0]
    assert (logits - hf_logits(model, tokens, positions)).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_captured_graph_prints_and_parses_identically(captured, arch):
    text = print_graph(captured(arch)[1])
    assert print_graph(parse_graph(text)) == text


def test_capture_keeps_batch_and_seq_symbolic(captured):
    graph = captured("llama")[1]
    assert [str(v.type) for v in graph.inputs] == ["i64[batch, seq]", "i64[batch, seq]"]
    assert str(graph.outputs[0].type) == f"f32[batch, seq, {VOCAB_SIZE}]"
    assert {n.op for n in graph.nodes} >= {"attention", "linear", "embedding"}


@pytest.mark.slow
def test_real_smollm2_ir_matches_hugging_face_logits(smollm2_dir):
    model, notes = load_model(smollm2_dir).model, []
    graph = capture_causal_lm(model, max_batch=2, max_seq_len=64, note=notes.append)
    assert notes == ["capture: 2 of 30 decoder layers traced (the first and 1 kind(s))"]
    torch.manual_seed(2)
    tokens = torch.randint(0, model.config.vocab_size, (2, 17))
    positions = torch.arange(17).expand(2, 17)
    logits = run_graph(graph, [tokens, positions])[0]
    assert (logits - hf_logits(model, tokens, positions)).abs().max() <= 1e-4


def test_layers_alike_are_traced_once_and_others_on_their_own(monkeypatch):
    """The capture traces layer 0 and the first later layer of each kind (layer_templates.py);
    a layer whose weights differ in shape is its own kind; a setting that makes the layer's
    index part of its math (GPT-2's inverse-index scaling), or KILN_CAPTURE_LAYERS=full, makes
    every layer traced."""
    from transformers import AutoModelForCausalLM

    from kiln.frontend.layer_templates import SWITCH, plan_layers
    from tiny_models import tiny_config

    llama = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=5))
    plan = plan_layers(llama)
    assert (plan.container, plan.templates, plan.template_of) == ("model.layers", [0, 1], [0, 1, 1, 1, 1])
    llama.model.layers[3].mlp.down_proj = torch.nn.Linear(96, 64, bias=False)
    assert plan_layers(llama).template_of == [0, 1, 1, 3, 1]
    gpt2 = AutoModelForCausalLM.from_config(tiny_config("gpt2", n_layer=3, scale_attn_by_inverse_layer_idx=True))
    assert plan_layers(gpt2) == "no two decoder layers alike after the first"
    monkeypatch.setenv(SWITCH, "full")
    assert plan_layers(llama) == f"{SWITCH}=full"


class UsesAnUnmappedOp(torch.nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x) + 1  # no IR op computes Bessel functions


def test_unmapped_op_names_the_op_and_the_source_line():
    with pytest.raises(UnsupportedOpError) as info:
        capture_module(UsesAnUnmappedOp(), [torch.randn(3, 4)], ["x"], ["y"])
    message = str(info.value)
    assert "special_bessel_j0" in message
    assert "test_capture.py:" in message and "[3, 4]" in message
    assert info.value.source_line.endswith(f":{UsesAnUnmappedOp.forward.__code__.co_firstlineno + 1}")


def test_a_guard_torch_cannot_prove_is_deferred_to_a_run_time_assert(monkeypatch, tmp_path):
    """torch 2.11's export raises ConstraintViolationError on guards that hold for every seq
    (min(16*seq, 32*seq) == 16*seq); capture then exports again with the guards deferred, and the
    IR computes the same logits."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    export, calls = torch.export.export, []

    def strict_solver(*args, **kwargs):
        calls.append(kwargs.get("prefer_deferred_runtime_asserts_over_guards", False))
        if not calls[-1]:
            raise ConstraintViolationError("Constraints violated (seq)! min(16*seq, 32*seq) == 16*seq")
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", strict_solver)
    model = load_model(save_tiny_checkpoint("llama", tmp_path)).model
    graph = capture_causal_lm(model, max_batch=1, max_seq_len=64)
    assert calls[:2] == [False, True]
    verify(graph)
    tokens = torch.randint(0, VOCAB_SIZE, (1, 9), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(9)[None]
    assert (run_graph(graph, [tokens, positions])[0] - hf_logits(model, tokens, positions)).abs().max() <= 1e-4
