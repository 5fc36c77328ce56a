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


# -- quantized experts ---------------------------------------------------------------------------
def quantized_experts(bits: int, group_size: int, symmetric: bool, experts=4, out=48, k=128):
    """Random experts [experts, out, k] rounded as linear_q's layout stacks them: (qweight, scales, zeros)."""
    from kiln.passes.round_to_nearest import quantize_weight

    weights = torch.randn(experts, out, k, generator=torch.Generator().manual_seed(bits + group_size))
    q = quantize_weight(weights.flatten(0, 1), bits, group_size, symmetric)
    return tuple(None if t is None else t.view(experts, out, -1) for t in (q.qweight, q.scales, q.zeros))


@pytest.mark.parametrize("form", ["q8", "i8", "q4", "q4-zeros"])
def test_the_quantized_op_runs_kilns_kernels_per_routed_expert(form):
    from kiln.backends.inductor import int4_kernel, int8_kernel
    from kiln.ir.ops.routing import gathered_matmul_q_reference

    gathered_matmul.ensure_loaded()
    bits, group_size = (8, 128) if form in ("q8", "i8") else (4, 32 if form == "q4" else 64)
    qweight, scales, zeros = quantized_experts(bits, group_size, symmetric=form != "q4-zeros")
    ids = torch.tensor([0, 2, 2, 0, 1, 3, 3, 3])
    x = torch.randn(len(ids), 128, 1, generator=torch.Generator().manual_seed(1))
    want = gathered_matmul_q_reference(qweight, scales, ids, x, zeros, bits, group_size)
    if form == "q8":
        int8_kernel.ensure_loaded()
        packed = torch.stack([int8_kernel.pack_int8_weight(expert) for expert in qweight])
        got = torch.ops.kiln.gathered_linear_q(packed, scales.flatten(1), None, ids, x, group_size)
    elif form == "i8":  # f32 activations: exact
        got = torch.ops.kiln.gathered_linear_q(
            qweight.transpose(1, 2).contiguous(), scales.flatten(1), None, ids, x, 128
        )
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    else:
        int4_kernel.ensure_loaded()
        got = torch.ops.kiln.gathered_linear_q(qweight, scales, zeros, ids, x, group_size)
    # q8 / q4 round each row of x to int8 per block of 32, as linear_q8 / linear_q4 do
    assert float((got - want).norm() / want.norm()) < 0.01


def copy_graph(graph):
    from kiln.ir import parse_graph, print_graph

    copy = parse_graph(print_graph(graph))
    copy.weights = dict(graph.weights)
    return copy


OPTIONS = {"max_batch": 2, "max_seq_len": 64}


@pytest.fixture(scope="module")
def mixtral(tiny_model_dirs):
    """scheme -> the tiny Mixtral through the pipeline with `quantize=scheme` (None: f32), once each."""
    from kiln.backends.executable import BackendOptions
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.passes.pipeline import run_pipeline

    captured = capture_causal_lm(load_model(tiny_model_dirs("mixtral")).model, **OPTIONS)
    graphs = {}

    def get(scheme):
        if scheme not in graphs:
            graphs[scheme] = run_pipeline(copy_graph(captured), BackendOptions(**OPTIONS, quantize=scheme))
        return graphs[scheme]

    get.f32_weights = captured.weights
    return get


def test_quantize_rounds_each_expert_as_a_linears_weight_alone(mixtral):
    from kiln.passes.round_to_nearest import quantize_weight

    graph = mixtral("int4-g32")
    experts = [n for n in graph.nodes if n.op == "gathered_matmul_q"]
    assert len(experts) == 2 * graph.meta["kv_cache"]["layers"]
    assert not any(n.op == "gathered_matmul" for n in graph.nodes)
    assert all(n.attrs == {"bits": 4, "group_size": 32} for n in experts)
    qweight, scales, _, _, zeros = experts[-1].inputs  # the last layer's down_proj: 4 experts [64, 128]
    assert qweight.type.shape == (4, 64, 64) and scales.type.shape == (4, 64, 4) and zeros is None
    down_proj = f"model.layers.{graph.meta['kv_cache']['layers'] - 1}.mlp.experts.down_proj"
    original = mixtral.f32_weights[down_proj]
    for e in range(4):
        alone = quantize_weight(original[e], 4, 32, symmetric=True)
        assert torch.equal(graph.weights[qweight.name][e], alone.qweight)
        assert torch.equal(graph.weights[scales.name][e], alone.scales)
    assert down_proj not in graph.params  # the f32 experts are gone


def feeds_in_steps():
    """A prefill of two rows of different lengths' tokens, then two decode steps."""
    tokens = torch.randint(3, 512, (2, 6), generator=torch.Generator().manual_seed(2))
    steps = [(tokens, torch.arange(6).expand(2, 6))]
    return steps + [(tokens[:, i : i + 1] + 1, torch.full((2, 1), 6 + i)) for i in range(2)]


@pytest.mark.parametrize(
    "backend, scheme",
    [
        ("onnxruntime", "int8"),  # GatherBlockQuantized
        ("onnxruntime", "int4-g32-asym"),  # ... with zero points
        ("onnxruntime", "int4-g32-fit"),  # fractional zero points: Gather + dequantizing ops
        pytest.param("tinygrad", "int4-g32", marks=pytest.mark.slow),
        pytest.param("inductor", "int8", marks=pytest.mark.slow),
        pytest.param("inductor", "int4-g32-asym", marks=pytest.mark.slow),
    ],
)
def test_quantized_experts_on_each_backend_equal_the_interpreter(
    mixtral, backend, scheme, exact_activations, monkeypatch
):
    from kiln.backends.executable import BackendOptions
    from kiln.backends.registry import get_backend

    monkeypatch.setenv("KILN_INT8_KERNEL", "i8")  # Inductor's int8 kernel with f32 activations: exact
    graph = mixtral(scheme)
    options = BackendOptions(**OPTIONS)
    executable, oracle = get_backend(backend).lower(graph, options), get_backend("reference").lower(graph, options)
    # Inductor's int4 kernel rounds each row of activations to int8 per block of 32, an error that
    # grows layer by layer: 0.080 for the 3-layer model's prefill, 0.038 and 0.027 for its decodes
    tolerance = 0.1 if (backend, scheme) == ("inductor", "int4-g32-asym") else 1e-5
    for tokens, positions in feeds_in_steps():
        expected, got = oracle.run(tokens, positions), executable.run(tokens, positions)
        assert float((got - expected).norm() / expected.norm()) < tolerance


def with_experts_dequantized(graph):
    """The unquantized-expert path: each gathered_matmul_q back to a gathered_matmul over the f32
    experts its codes stand for."""
    from kiln.ir.ops.quantized import dequantize

    copy = copy_graph(graph)
    for node in [n for n in copy.nodes if n.op == "gathered_matmul_q"]:
        qweight, scales, ids, x, zeros = node.inputs
        parts = [None if v is None else copy.weights[v.name] for v in (qweight, scales, zeros)]
        experts = copy.add_param(copy.fresh_name(qweight.name + ".f32"), dequantize(*parts, **node.attrs))
        replacement = copy.create("gathered_matmul", [experts, ids, x])
        copy.insert_before(node, replacement)
        copy.replace_all_uses(node.output, replacement.output)
        copy.erase(node)
    return copy


@pytest.mark.parametrize("backend", ["onnxruntime"])
def test_quantized_experts_generate_what_their_dequantized_weights_do(
    tiny_model_dirs, mixtral, backend, exact_activations
):
    from hf_oracle import prompts
    from kiln.backends.executable import BackendOptions
    from kiln.backends.registry import get_backend
    from kiln.runtime.generate import LLM
    from kiln.runtime.tokenizer import Tokenizer

    tokenizer, options = Tokenizer.from_dir(tiny_model_dirs("mixtral")), BackendOptions(**OPTIONS)
    batch = prompts([5, 12], seed=1)
    graph = mixtral("int4-g32")
    results = [
        [
            r.token_ids
            for r in LLM(get_backend(backend).lower(g, options), tokenizer, graph=g).generate(batch, max_new_tokens=16)
        ]
        for g in (graph, with_experts_dequantized(graph))
    ]
    assert results[0] == results[1]
