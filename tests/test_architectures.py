"""Families beyond the Llama shape, against Hugging Face eager on every backend.

BLOOM and MPT (ALiBi), Falcon (multi-query attention, picked out of the fused qkv by index
lists) and Gemma 2 (attention-logit soft-capping) have no SDPA path in transformers: they load
with eager attention, which `fuse_attention_pattern` turns into `attention` with its `alibi`
slopes or `softcap`. Mixtral and OLMoE route each token to its top-2 experts (`topk`), whose
stacked weights are gathered by the chosen ids. Each tiny seeded model (3 layers; Gemma 2's 4
alternate sliding and full) is captured from its first layer and one of each kind, the others
copies of those (frontend/layer_templates.py). It must give the interpreter's logits within
1e-4 of Hugging Face's, and on each backend greedy tokens identical to Hugging Face's for one
prompt and for a batch of two prompts of different lengths.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import hf_greedy, prompts
from kiln.backends.executable import BackendOptions
from kiln.backends.registry import get_backend
from kiln.frontend.capture import capture_causal_lm
from kiln.frontend.checkpoint import load_model
from kiln.ir import parse_graph, print_graph, run_graph
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.generate import LLM
from kiln.runtime.tokenizer import Tokenizer
from tiny_models import EOS_TOKEN_ID, FAMILIES, tiny_config

NEW_TOKENS = 32
OPTIONS = BackendOptions(max_batch=2, max_seq_len=128)
BATCHES = {"one": prompts([9]), "two": prompts([5, 12], seed=1)}
# tinygrad's first steps of each shape and Inductor's compiles take 20-60 s per model on two cores.
BACKENDS = [
    "onnxruntime",
    pytest.param("tinygrad", marks=pytest.mark.slow),
    pytest.param("inductor", marks=pytest.mark.slow),
]
ALIBI = {"bloom", "mpt"}
MOE = {"mixtral", "olmoe"}
CAPTURE_NOTES: dict[str, list[str]] = {}


@pytest.fixture(scope="module")
def compiled(tiny_model_dirs):
    """family -> (the pipeline's stateful graph, HF model, HF's greedy tokens per batch), once.
    The capture traces one layer of each kind and copies it (CAPTURE_NOTES says so)."""
    cache = {}

    def get(family):
        if family not in cache:
            model = load_model(tiny_model_dirs(family)).model
            notes = CAPTURE_NOTES.setdefault(family, [])
            captured = capture_causal_lm(model, OPTIONS.max_batch, OPTIONS.max_seq_len, note=notes.append)
            graph = run_pipeline(captured, OPTIONS)
            expected = {
                name: [hf_greedy(model, p, NEW_TOKENS, {EOS_TOKEN_ID}) for p in batch]
                for name, batch in BATCHES.items()
            }
            cache[family] = graph, model, expected
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_ir_logits_match_hugging_face_eager(compiled, family):
    graph, model, _ = compiled(family)
    attentions = [n for n in graph.nodes if n.op == "attention"]
    assert len(attentions) == model.config.num_hidden_layers
    traced = 3 if family == "gemma2" else 2  # the first layer, then one per kind (Gemma 2: sliding, full)
    layers = model.config.num_hidden_layers
    assert CAPTURE_NOTES[family] == [
        f"capture: {traced} of {layers} decoder layers traced (the first and {traced - 1} kind(s))"
    ]
    routers = sum(n.op == "topk" for n in graph.nodes)  # each MoE layer's softmax feeds its topk
    assert sum(n.op == "softmax" for n in graph.nodes) == routers
    if family in ALIBI:  # BLOOM's and MPT's slopes for 4 heads: 2^-2, 2^-4, 2^-6, 2^-8
        assert all(n.attrs["alibi"] == pytest.approx([0.25, 0.0625, 0.015625, 0.00390625]) for n in attentions)
    if family == "gemma2":
        assert all(n.attrs["softcap"] == 5.0 for n in attentions)
    assert routers == (model.config.num_hidden_layers if family in MOE else 0)
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)  # the artifact's text form
    tokens = torch.randint(3, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(17).expand(2, 17)
    caches = {v.name: torch.zeros(tuple(v.type.shape)) for v in graph.inputs[2:]}
    logits = run_graph(graph, {"tokens": tokens, "positions": positions, **caches})[0]
    with torch.no_grad():
        expected = model(input_ids=tokens, position_ids=positions).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hugging_face_on_every_backend(tiny_model_dirs, compiled, family, backend):
    graph, _, expected = compiled(family)
    llm = LLM(get_backend(backend).lower(graph, OPTIONS), Tokenizer.from_dir(tiny_model_dirs(family)), graph=graph)
    for name, batch in BATCHES.items():
        results = llm.generate(batch, max_new_tokens=NEW_TOKENS)
        assert [r.token_ids for r in results] == expected[name], f"batch {name}"


def test_tensor_parallel_ranks_keep_the_alibi_slopes_of_their_query_heads(compiled):
    from kiln.passes.shard_tensor_parallel import shard_tensor_parallel

    graph, _, _ = compiled("mpt")
    full = [n.attrs["alibi"] for n in graph.nodes if n.op == "attention"]
    for rank, heads in ((0, slice(0, 2)), (1, slice(2, 4))):
        shard = shard_tensor_parallel(graph, rank, 2)
        assert [n.attrs["alibi"] for n in shard.nodes if n.op == "attention"] == [s[heads] for s in full]


def test_mpt_captures_at_its_own_max_seq_len_and_matches_hugging_face_there():
    """MPT slices its ALiBi bias off a table of its max_seq_len keys: a capture whose longest
    sequence is that length (torch.export specializes the slice there) gives HF's logits at it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("mpt", max_seq_len=24), attn_implementation="eager").eval()
    limit = model.config.max_seq_len
    graph = capture_causal_lm(model, max_batch=1, max_seq_len=limit)
    assert model.config.max_seq_len == limit and graph.symbols["seq"].max == limit
    tokens = torch.randint(3, 512, (1, limit), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(limit)[None]
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    torch.testing.assert_close(run_graph(graph, [tokens, positions])[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "onnxruntime"])
def test_a_moe_step_computes_only_the_experts_its_token_routes_to(compiled, monkeypatch, backend):
    """NaN in the weights of every expert the token does not route to leaves its logits as they
    were: those experts are neither read nor computed (a dense mixture would spread the NaN)."""
    graph, model, _ = compiled("mixtral")
    prompt = prompts([1], seed=5)[0]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), output_router_logits=True)
    experts, top_k = model.config.num_local_experts, model.config.num_experts_per_tok
    poisoned = dict(graph.weights)
    for layer, router_logits in enumerate(out.router_logits):
        unused = sorted(set(range(experts)) - set(router_logits[-1].topk(top_k).indices.tolist()))
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{layer}.mlp.experts.{name}"
            poisoned[key] = poisoned[key].clone()
            poisoned[key][unused] = float("nan")
    monkeypatch.setattr(graph, "weights", poisoned)
    logits = get_backend(backend).lower(graph, OPTIONS).run(torch.tensor([prompt]), torch.tensor([[0]]))
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0, -1], out.logits[0, -1], atol=1e-4, rtol=0)
