"""Each distinct decoder layer compiled once (backends/inductor/outline_layers.py).

The tiny Gemma 3 alternates sliding and full attention over 4 layers: its first layer (a norm with
no residual to add yet), its sliding layers and its full layers are three bodies. The outlined FX
module must compute what the full one does; the AOTInductor package built from it (slow: a
compile) must generate Hugging Face's greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_oracle import hf_greedy, prompts
from kiln.backends.executable import BackendOptions, fed_inputs
from kiln.backends.inductor import load, lower
from kiln.backends.inductor.aoti_package import LAYERS_SWITCH, PACKAGE_INFO_FILE
from kiln.backends.inductor.outline_layers import outline_layers
from kiln.frontend.capture import capture_causal_lm
from kiln.frontend.checkpoint import load_model
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.generate import LLM
from kiln.runtime.tokenizer import Tokenizer
from tiny_models import EOS_TOKEN_ID

OPTIONS = BackendOptions(max_batch=1, max_seq_len=64)


@pytest.fixture(scope="module")
def gemma3(tiny_model_dirs):
    model = load_model(tiny_model_dirs("gemma3")).model
    graph = run_pipeline(capture_causal_lm(model, OPTIONS.max_batch, OPTIONS.max_seq_len), OPTIONS)
    return model, graph


def test_layers_of_each_kind_share_one_body_and_compute_the_full_graph(gemma3):
    _, graph = gemma3
    module = lower(graph, OPTIONS).module
    outlined, bodies = outline_layers(module)
    assert bodies == 3
    calls = [n for n in outlined.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert [c.args[1] for c in calls] == ["kiln_layer_0", "kiln_layer_1", "kiln_layer_2", "kiln_layer_1"]
    positions = torch.tensor([[0, 1]])
    given = {"tokens": torch.tensor([[5, 17]]), "positions": positions, "slots": positions}
    given["tree"] = torch.ones(1, 2, 2, dtype=torch.bool).tril()
    feeds = [given[v.name] for v in fed_inputs(graph)]

    def logits_and_caches(m):
        for buffer in m.buffers():
            buffer.zero_()
        with torch.no_grad():
            return m(*feeds)[0].clone(), [b.clone() for b in m.buffers()]

    expected, expected_caches = logits_and_caches(module)
    logits, caches = logits_and_caches(outlined)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    assert any(c.abs().sum() > 0 for c in caches)
    for cache, expected_cache in zip(caches, expected_caches):
        torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0)


@pytest.mark.slow
def test_a_package_of_layer_bodies_generates_hugging_faces_greedy_tokens(
    gemma3, tiny_model_dirs, tmp_path, monkeypatch
):
    model, graph = gemma3
    monkeypatch.setenv(LAYERS_SWITCH, "once")
    lower(graph, OPTIONS).save(tmp_path)
    assert json.loads((tmp_path / PACKAGE_INFO_FILE).read_text())["layer_bodies"] == 3
    executable = load(tmp_path, graph, graph.weights, OPTIONS)
    llm = LLM(executable, Tokenizer.from_dir(tiny_model_dirs("gemma3")), graph=graph)
    prompt = prompts([12], seed=2)  # longer than the sliding window once generation runs
    expected = [hf_greedy(model, p, 24, {EOS_TOKEN_ID}) for p in prompt]
    assert [r.token_ids for r in llm.generate(prompt, max_new_tokens=24)] == expected
