"""Mixed precision from sensitivity (passes/mixed_precision.py) on the tiny seeded llama."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kiln.backends import reference
from kiln.backends.executable import BackendOptions
from kiln.passes.mixed_precision import choose_int8_layers, layer_of, layer_sensitivity, layer_weights, quantize_mixed
from kiln.passes.quant_schemes import get_scheme
from kiln.runtime.quality import compare_executables
from tiny_models import TRAINING_TEXT

LENGTH = 64


@pytest.fixture(scope="module")
def tiny(tiny_model_dirs):
    """The tiny llama through canonicalize + fuse (what the quantize phase sees), and token rows."""
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.passes.pipeline import default_pipeline
    from kiln.runtime.tokenizer import Tokenizer

    directory = tiny_model_dirs("llama")
    captured = capture_causal_lm(load_model(directory).model, max_batch=1, max_seq_len=LENGTH)
    manager = default_pipeline(BackendOptions(max_seq_len=LENGTH))
    manager.phases = [p for p in manager.phases if p[0] in ("canonicalize", "fuse")]
    ids = Tokenizer.from_dir(directory).encode(TRAINING_TEXT * 2, add_special_tokens=False)
    return manager.run(captured), torch.tensor(ids[: 4 * LENGTH]).view(4, LENGTH)


def copy_graph(graph):
    from kiln.ir import parse_graph, print_graph

    copy = parse_graph(print_graph(graph))
    copy.weights = dict(graph.weights)
    copy.meta = dict(graph.meta)
    return copy


def executable(stateless):
    from kiln.passes.pipeline import kv_cache_insertion

    options = BackendOptions(max_seq_len=LENGTH)
    return reference.lower(kv_cache_insertion(options).run(copy_graph(stateless)), options)


def test_the_budget_buys_int8_for_the_most_sensitive_layer_and_it_pays(tiny):
    graph, tokens = tiny
    base = get_scheme("int4-g32")
    layers = layer_weights(graph, base, include_embeddings=False)
    assert list(layers) == ["layer 0", "layer 1"] and all(len(names) >= 3 for names in layers.values())
    sensitivity = layer_sensitivity(graph, base, layers, tokens[:2])
    assert all(value > 0 for value in sensitivity.values())
    most = max(sensitivity, key=sensitivity.get)
    assert choose_int8_layers(graph, layers, sensitivity, base, 6.8) == [most]  # room for one layer
    assert choose_int8_layers(graph, layers, sensitivity, base, 5.0) == []  # int4-g32 itself: 5 bits
    assert sorted(choose_int8_layers(graph, layers, sensitivity, base, 8.6)) == ["layer 0", "layer 1"]

    scheme = replace(get_scheme("int4-mixed"), budget_bits=6.8)
    mixed = quantize_mixed(copy_graph(graph), scheme, tokens[:2])
    bits = {n.attrs["bits"] for n in mixed.nodes if n.op == "linear_q" and layer_of(n.inputs[1].name) == most}
    assert bits == {8} and {n.attrs["bits"] for n in mixed.nodes if n.op == "linear_q"} == {4, 8}
    meta = mixed.meta["quantization"]
    assert meta["int8_layers"] == [most] and meta["weight_bytes_after"] * 8 <= 6.8 * meta["weight_bytes_before"] / 4
    from kiln.passes.quantize_weights import quantize_weights

    f32 = executable(graph)
    int4 = compare_executables(executable(quantize_weights(copy_graph(graph), base)), f32, tokens)
    assert compare_executables(executable(mixed), f32, tokens).mean_kld < int4.mean_kld


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "inductor"])
def test_a_mixed_graph_lowers_and_runs_close_to_the_interpreter(tiny, backend):
    """int8 and int4 linears side by side in one graph: each backend's kernels (which round
    activations to int8) stay within the KLD they show on one precision alone."""
    from kiln.backends.registry import get_backend
    from kiln.passes.pipeline import kv_cache_insertion

    graph, tokens = tiny
    mixed = quantize_mixed(copy_graph(graph), replace(get_scheme("int4-mixed"), budget_bits=6.8), tokens[:1])
    options = BackendOptions(max_seq_len=LENGTH)
    stateful = kv_cache_insertion(options).run(mixed)
    assert {n.attrs["bits"] for n in stateful.nodes if n.op == "linear_q"} == {4, 8}
    lowered = get_backend(backend).lower(copy_graph(stateful), options)
    assert compare_executables(lowered, reference.lower(copy_graph(stateful), options), tokens).mean_kld < 0.005
