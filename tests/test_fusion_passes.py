"""The fusion passes: each keeps the interpreter's results and rewrites its pattern on the tiny models.

Every pass runs on each tiny architecture (and GPT-2 / Llama captured with eager attention), on
the graph the passes before it in the `fuse` phase left; the test compares the interpreter's
logits before and after it on random tokens, and counts what the pass rewrote.
"""

from __future__ import annotations

import pytest
import torch

from kiln.frontend.capture import capture_causal_lm, capture_module
from kiln.frontend.checkpoint import load_model
from kiln.ir import Graph, TensorType, print_graph, run_graph, symbol, verify
from kiln.passes import canonicalize, eliminate_dead_code, fold_constants
from kiln.passes.fuse_attention_pattern import fuse_attention_pattern
from kiln.passes.fuse_layer_norm import fuse_layer_norm
from kiln.passes.fuse_projections import fuse_projections, merged_name
from kiln.passes.fuse_rope import fuse_rope, position_function
from kiln.passes.pipeline import fusion_passes, run_pipeline

MAX_SEQ = 32
MODELS = ["gpt2", "llama", "qwen2", "mistral", "gemma3", "gpt2-eager", "llama-eager"]
PASSES = [p.name for p in fusion_passes() if p.name not in ("canonicalize", "dce")]


def count(graph: Graph, *ops: str) -> int:
    return sum(n.op in ops for n in graph.nodes)


def biased_linears(graph: Graph) -> int:
    return sum(n.op == "linear" and n.inputs[2] is not None for n in graph.nodes)


def flat_linears(graph: Graph) -> int:
    return sum(n.op == "linear" and n.inputs[0].type.rank == 2 for n in graph.nodes)


# What each pass rewrote, from the graphs before and after it.
REWRITTEN = {
    "fuse_attention_pattern": lambda a, b: count(b, "attention") - count(a, "attention"),
    "fold_transposes": lambda a, b: count(a, "matmul") - count(b, "matmul"),
    "fuse_bias_activation": lambda a, b: (
        biased_linears(b) - biased_linears(a) + count(b, "silu", "gelu") - count(a, "silu", "gelu")
    ),
    "fold_linear_reshapes": lambda a, b: flat_linears(a) - flat_linears(b),
    "fuse_rope": lambda a, b: count(b, "rope"),
    "fuse_layer_norm": lambda a, b: count(b, "layer_norm") - count(a, "layer_norm"),
    "fuse_rms_norm": lambda a, b: count(b, "rms_norm"),
    "fold_norm_casts": lambda a, b: count(a, "cast") - count(b, "cast"),
    "fuse_add_rms_norm": lambda a, b: count(b, "add_rms_norm"),
    "fuse_projections": lambda a, b: count(a, "linear") - count(b, "linear"),
    "fuse_gathered_matmul": lambda a, b: count(b, "gathered_matmul"),
}
# Per model: gpt2 has 2 layers of Conv1D linears (4 each) with gelu_new; llama, qwen2, mistral 2
# layers with q/k/v + gate/up (3 linears merged away per layer) and 2 norms each + the final one;
# gemma3 4 layers with 4 norms + q/k norms each, GELU already whole, two kinds of rope layers.
EXPECTED = {
    "fuse_attention_pattern": {"gpt2-eager": 2, "llama-eager": 2},
    "fold_transposes": {"gpt2": 8, "gpt2-eager": 8},
    # Llama-family MLPs arrive as `silu` already (the training IR keeps aten.silu); the spelled-out
    # form is tested on a hand-built graph below.
    "fuse_bias_activation": {"gpt2": 10, "gpt2-eager": 10},
    "fold_linear_reshapes": {"gpt2": 8, "gpt2-eager": 8},
    "fuse_rope": {"llama": 4, "qwen2": 4, "mistral": 4, "gemma3": 8, "llama-eager": 4},
    "fuse_layer_norm": {},  # torch.export keeps nn.LayerNorm whole: see the hand-written test below
    "fuse_rms_norm": {"llama": 5, "qwen2": 5, "mistral": 5, "gemma3": 25, "llama-eager": 5},
    "fold_norm_casts": {},  # f32 models have no casts around their norms: see the f16 test below
    "fuse_add_rms_norm": {"llama": 4, "qwen2": 4, "mistral": 4, "gemma3": 8, "llama-eager": 4},
    "fuse_projections": {"llama": 6, "qwen2": 6, "mistral": 6, "gemma3": 12, "llama-eager": 6},
    "fuse_gathered_matmul": {},  # dense models: MoE captures in tests/test_gathered_matmul.py
}


def copy_graph(graph: Graph) -> Graph:
    """A copy whose nodes and values are new (passes edit in place); types and weights are shared."""
    clone = Graph()
    clone.symbols, clone.meta, clone.weights = dict(graph.symbols), dict(graph.meta), dict(graph.weights)
    new = {id(v): clone.add_input(v.name, v.type) for v in graph.inputs}
    new.update({id(v): clone.add_param(name, type=v.type) for name, v in graph.params.items()})
    for node in graph.nodes:
        inputs = [None if v is None else new[id(v)] for v in node.inputs]
        copy = clone.make_node(
            node.op, inputs, node.attrs, [v.type for v in node.outputs], [v.name for v in node.outputs]
        )
        clone.append(copy)
        new.update({id(v): c for v, c in zip(node.outputs, copy.outputs)})
    clone.outputs = [new[id(v)] for v in graph.outputs]
    return clone


def sample_feeds(seq: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, 512, (2, seq), generator=g), "positions": torch.arange(seq).expand(2, seq)}


def assert_same_outputs(before: list, after: list) -> None:
    assert len(before) == len(after)
    for want, got in zip(before, after):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def captured(tiny_model_dirs):
    """model name ("llama", "gpt2-eager") -> its canonicalized stateless graph (a fresh copy each call)."""
    cache = {}

    def get(name: str) -> Graph:
        if name not in cache:
            arch, _, attention = name.partition("-")
            model = load_model(tiny_model_dirs(arch)).model
            if attention:
                model.set_attn_implementation(attention)
            graph = capture_causal_lm(model, max_batch=2, max_seq_len=MAX_SEQ)
            for cleanup in (canonicalize, fold_constants, eliminate_dead_code):
                graph = cleanup(graph)
            cache[name] = graph
        return copy_graph(cache[name])

    return get


@pytest.fixture(scope="module")
def before_pass(captured):
    """(model, pass name) -> the graph the passes before it in the fuse phase leave."""
    cache = {}

    def get(model: str, name: str) -> Graph:
        if (model, name) not in cache:
            graph = captured(model)
            for p in fusion_passes():
                cache.setdefault((model, p.name), copy_graph(graph))
                graph = p(graph)
        return copy_graph(cache[(model, name)])

    return get


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pass_name", PASSES)
def test_fusion_pass_keeps_results_and_rewrites_its_pattern(before_pass, model, pass_name):
    fusion = next(p for p in fusion_passes() if p.name == pass_name)
    graph = before_pass(model, pass_name)
    untouched = copy_graph(graph)
    graph = fusion(graph)
    verify(graph)
    rewritten = EXPECTED[pass_name].get(model, 0)
    assert REWRITTEN[pass_name](untouched, graph) == rewritten
    if rewritten == 0:  # nothing to match: the graph must be exactly as it was
        assert print_graph(graph) == print_graph(untouched)
    else:
        assert_same_outputs(run_graph(untouched, sample_feeds()), run_graph(graph, sample_feeds()))


@pytest.mark.parametrize("arch, norms, residual_adds", [("llama", 5, 4), ("gemma3", 25, 8)])
def test_half_precision_norms_lose_their_f32_casts_and_then_take_the_residual_add(
    tiny_model_dirs, arch, norms, residual_adds
):
    """An f16 capture computes each norm between casts to f32 and back (Llama: weight multiplied
    after; Gemma: weight cast to f32 inside): fold_norm_casts makes each one f16 rms_norm."""
    graph = capture_causal_lm(
        load_model(tiny_model_dirs(arch)).model, max_batch=2, max_seq_len=MAX_SEQ, dtype=torch.float16
    )
    for cleanup in (canonicalize, fold_constants, eliminate_dead_code):
        graph = cleanup(graph)
    passes = {p.name: p for p in fusion_passes()}
    for p in fusion_passes():
        if p.name == "fold_norm_casts":
            break
        graph = p(graph)
    untouched = copy_graph(graph)
    graph = passes["fold_norm_casts"](graph)
    verify(graph)
    assert count(untouched, "rms_norm") == count(graph, "rms_norm") == norms
    half_norms = [n for n in graph.nodes if n.op == "rms_norm" and n.inputs[0].type.dtype == "f16"]
    assert len(half_norms) == norms and all(n.inputs[1].type.dtype == "f16" for n in half_norms)
    assert count(graph, "cast") == 1  # only the logits' cast to f32 is left
    before, after = run_graph(untouched, sample_feeds()), run_graph(graph, sample_feeds())
    torch.testing.assert_close(after[0], before[0], atol=0.05, rtol=0.01)  # f16: one rounding may differ
    assert before[0].dtype == after[0].dtype == torch.float32
    assert count(passes["fuse_add_rms_norm"](graph), "add_rms_norm") == residual_adds


@pytest.mark.parametrize("model", ["llama", "gemma3", "gpt2-eager"])
def test_fuse_phase_leaves_no_trig_rotate_half_or_eager_softmax(before_pass, model):
    graph = before_pass(model, PASSES[0])
    for p in fusion_passes():
        graph = p(graph)
    assert count(graph, "cos", "sin", "neg", "softmax", "matmul", "rsqrt", "sigmoid") == 0


def decode_logits(graph: Graph, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Interpreter logits of the stateful graph: a prefill of `prefill` tokens, then one call per token."""
    caches = {v.name: torch.zeros(v.type.shape) for v in graph.inputs[2:]}
    calls = [(0, prefill)] + [(t, t + 1) for t in range(prefill, tokens.size(1))]
    logits = []
    for start, end in calls:
        feeds = {"tokens": tokens[:, start:end], "positions": torch.arange(start, end).expand(2, end - start), **caches}
        outputs = run_graph(graph, feeds)
        logits.append(outputs[0])
        caches = {v.name: t for v, t in zip(graph.inputs[2:], outputs[1:])}
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("model", ["llama", "gemma3", "gpt2-eager", "llama-eager"])
def test_kv_cache_insertion_works_on_fused_graphs(captured, model):
    stateless = captured(model)
    options = type("Options", (), {"max_batch": 2, "max_seq_len": MAX_SEQ})()
    fused = run_pipeline(captured(model), options)
    layers = fused.meta["kv_cache"]["layers"]
    assert count(fused, "kv_write") == 2 * layers and count(fused, "attention") == layers
    if model != "gpt2-eager":  # rope'd keys go straight into the cache, heads still grouped
        keys = [n.inputs[1] for n in fused.nodes if n.op == "kv_write" and n.inputs[0].name.startswith("cache.k")]
        assert all(k.producer.op == "rope" for k in keys) and all(k.type.shape[1] == 2 for k in keys)
    feeds = sample_feeds(7)
    expected = run_graph(stateless, feeds)[0]
    torch.testing.assert_close(decode_logits(fused, feeds["tokens"], prefill=5), expected, atol=1e-4, rtol=1e-5)


def test_gemma3_sliding_and_global_layers_get_their_own_rope_tables(before_pass):
    graph = before_pass("gemma3", "fuse_rope")
    inv_freq = {kind: graph.weights[f"model.rotary_emb.{kind}_attention_inv_freq"] for kind in ("sliding", "full")}
    graph = fuse_rope(graph)
    tables = sorted({n.inputs[2].name for n in graph.nodes if n.op == "rope"})
    assert len(tables) == 2
    positions = torch.arange(MAX_SEQ, dtype=torch.float32)[:, None]
    expected = [torch.cos(positions * f) for f in inv_freq.values()]
    for name in tables:
        table = graph.weights[name]
        assert table.shape == (MAX_SEQ, 8)
        assert sum(torch.allclose(table, e, atol=1e-6) for e in expected) == 1
    assert "model.rotary_emb.sliding_attention_inv_freq" not in graph.params


def test_partial_rotary_becomes_one_rope_over_the_whole_head():
    from transformers import AutoModelForCausalLM, PhiConfig

    torch.manual_seed(0)
    config = PhiConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
    )
    graph = capture_causal_lm(AutoModelForCausalLM.from_config(config).eval(), max_batch=2, max_seq_len=MAX_SEQ)
    graph = eliminate_dead_code(fold_constants(canonicalize(graph)))
    expected = run_graph(graph, sample_feeds())
    graph = fuse_rope(graph)
    ropes = [n for n in graph.nodes if n.op == "rope"]
    assert len(ropes) == 2 and all(n.inputs[0].type.shape[-1] == 16 for n in ropes)
    assert graph.weights[ropes[0].inputs[2].name].shape == (MAX_SEQ, 4)  # rotary dim 8 of 16
    assert count(graph, "neg", "cos", "sin") == 0
    assert_same_outputs(expected, run_graph(graph, sample_feeds()))


def test_cos_of_the_token_index_rather_than_its_position_is_no_table():
    graph = Graph()
    batch, seq = symbol("batch"), symbol("seq")
    graph.add_symbol("batch", 1, 2)
    graph.add_symbol("seq", 1, 8)
    positions = graph.add_input("positions", TensorType("i64", (batch, seq)))
    index = graph.call("cast", graph.call("arange", end=seq), dtype="f32")
    by_index = graph.call("cos", graph.call("add", graph.call("cast", positions, dtype="f32"), index))
    by_position = graph.call("sin", graph.call("cast", positions, dtype="f32"))
    assert position_function(graph, by_index) is None
    assert position_function(graph, by_position)[0] is positions


class HandWrittenLayerNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        centered = x - x.mean(-1, keepdim=True)
        return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight + self.bias


def test_hand_written_layer_norm_becomes_layer_norm():
    x = torch.randn(3, 8)
    graph = capture_module(HandWrittenLayerNorm(), (x,), ["x"], ["y"], {(0, 0): ("batch", 1, 4)})
    expected = run_graph(graph, [x])
    graph = fuse_layer_norm(canonicalize(graph))
    assert [n.op for n in graph.nodes] == ["layer_norm"]
    assert_same_outputs(expected, run_graph(graph, [x]))


def linears_sharing_an_input(tied: bool) -> Graph:
    graph = Graph()
    graph.add_symbol("batch", 1, 4)
    ids = graph.add_input("ids", TensorType("i64", (symbol("batch"),)))
    first, second = (
        graph.add_param("a.q_proj.weight", torch.randn(4, 4)),
        graph.add_param("a.k_proj.weight", torch.randn(2, 4)),
    )
    x = graph.call("embedding", first if tied else graph.add_param("embed", torch.randn(9, 4)), ids)
    graph.outputs = [graph.call("linear", x, first), graph.call("linear", x, second)]
    return graph


def test_projections_sharing_an_input_merge_into_one_linear_and_slices():
    graph = linears_sharing_an_input(tied=False)
    ids = torch.tensor([1, 5, 8])
    expected = run_graph(graph, [ids])
    graph = fuse_projections(graph)
    assert [n.op for n in graph.nodes] == ["embedding", "linear", "slice", "slice"]
    assert "a.q_proj-k_proj.weight" in graph.params
    assert_same_outputs(expected, run_graph(graph, [ids]))


def test_projections_with_a_weight_shared_elsewhere_stay_apart():
    graph = fuse_projections(linears_sharing_an_input(tied=True))
    assert count(graph, "linear") == 2


def test_merged_parameter_names_keep_prefix_and_suffix():
    assert (
        merged_name(["m.l.0.mlp.gate_proj.weight", "m.l.0.mlp.up_proj.weight"]) == "m.l.0.mlp.gate_proj-up_proj.weight"
    )


def test_attention_whose_probabilities_are_also_returned_is_left_alone(captured):
    graph = captured("gpt2-eager")
    softmax = next(n for n in graph.nodes if n.op == "softmax")
    graph.outputs.append(softmax.output)
    graph = fuse_attention_pattern(graph)
    assert count(graph, "attention") == 1 and count(graph, "softmax") == 1


@pytest.mark.slow
def test_every_fusion_fires_on_smollm2(smollm2_dir):
    graph = capture_causal_lm(load_model(smollm2_dir).model, max_batch=1, max_seq_len=64)
    graph = eliminate_dead_code(fold_constants(canonicalize(graph)))
    layers = graph.meta["model"]["num_layers"]
    for p in fusion_passes():
        graph = p(graph)
    assert count(graph, "rope") == 2 * layers and len({n.inputs[2].name for n in graph.nodes if n.op == "rope"}) == 1
    assert count(graph, "add_rms_norm") == 2 * layers and count(graph, "rms_norm") == 1
    assert count(graph, "silu") == layers and count(graph, "linear") == 4 * layers + 1  # qkv, o, gate_up, down
    assert count(graph, "cos", "sin", "rsqrt", "sigmoid", "neg") == 0


def test_silu_spelled_as_x_times_sigmoid_x_becomes_one_op():
    g = Graph()
    x = g.add_input("x", TensorType("f32", (3, 8)))
    g.outputs = [g.call("mul", x, g.call("sigmoid", x))]
    untouched = copy_graph(g)
    fused = next(p for p in fusion_passes() if p.name == "fuse_bias_activation")(g)
    assert count(fused, "silu") == 1 and count(fused, "sigmoid", "mul") == 0
    feed = [torch.randn(3, 8)]
    assert_same_outputs(run_graph(untouched, feed), run_graph(fused, feed))
