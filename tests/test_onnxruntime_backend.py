"""The onnxruntime backend: what it emits, how it runs, and that it generates what Hugging Face does."""

import json

import onnx
import pytest
import torch

import kiln
from hf_oracle import eos_ids, hf_greedy, prompts
from kiln.backends import onnxruntime as ort_backend
from kiln.backends import reference
from kiln.backends.executable import BackendOptions
from kiln.frontend.capture import capture_causal_lm
from kiln.frontend.checkpoint import load_model
from kiln.ir import Graph, TensorType
from kiln.passes.pipeline import run_pipeline
from kiln.runtime.generate import LLM
from kiln.runtime.tokenizer import Tokenizer
from tiny_models import ARCHITECTURES, VOCAB_SIZE

NEW_TOKENS = 64
OPTIONS = BackendOptions(max_batch=2, max_seq_len=128)


@pytest.fixture(scope="module")
def stateful_graph(tiny_model_dirs):
    """arch -> (the pipeline's stateful graph, HF model), captured once per module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model = load_model(tiny_model_dirs(arch)).model
            graph = capture_causal_lm(model, max_batch=OPTIONS.max_batch, max_seq_len=OPTIONS.max_seq_len)
            cache[arch] = run_pipeline(graph, OPTIONS), model
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def llms(stateful_graph, tiny_model_dirs):
    """arch -> (LLM over this backend's executable, HF model), lowered once per module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            graph, model = stateful_graph(arch)
            tokenizer = Tokenizer.from_dir(tiny_model_dirs(arch))
            cache[arch] = LLM(ort_backend.lower(graph, OPTIONS), tokenizer), model
        return cache[arch]

    return get


def feeds_in_steps():
    """(tokens, positions) for a batch-2 prefill, decode steps at different positions per row,
    and a multi-token step with past context (which GroupQueryAttention takes row by row)."""
    g = torch.Generator().manual_seed(0)
    steps = [(torch.randint(3, VOCAB_SIZE, (2, 12), generator=g), torch.arange(12).expand(2, 12))]
    for i in range(6):  # row 1 is shorter: it decodes from position 5 (its junk slots get overwritten)
        steps.append((torch.randint(3, VOCAB_SIZE, (2, 1), generator=g), torch.tensor([[12 + i], [5 + i]])))
    steps.append((torch.randint(3, VOCAB_SIZE, (2, 3), generator=g), torch.tensor([[18, 19, 20], [11, 12, 13]])))
    steps.append((torch.randint(3, VOCAB_SIZE, (1, 2), generator=g), torch.tensor([[21, 22]])))
    return steps


# -- the emitted model ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_emitted_model_passes_the_full_onnx_check(stateful_graph, arch, tmp_path):
    program = ort_backend.graph_to_onnx(stateful_graph(arch)[0])
    ort_backend.write_model(program, tmp_path)
    ort_backend.check_model(tmp_path / ort_backend.MODEL_FILE)


def test_smollm2_shaped_graph_uses_group_query_attention_and_fused_norms(stateful_graph):
    graph, _ = stateful_graph("llama")  # tiny llama has SmolLM2's shape (GQA, RoPE, RMSNorm, SwiGLU, tied)
    ops = ort_backend.graph_to_onnx(graph).op_types()
    layers = graph.meta["model"]["num_layers"]
    assert ops.count("GroupQueryAttention") == layers
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers  # each residual add + the next norm
    assert ops.count("RMSNormalization") == 1  # the first norm has no residual to add
    # genai's layer: packed qkv, o, gate, up, down (the fused gate/up projection is split back, no
    # Slice copies); between the matmuls only the kernels above, SwiGLU's math and GQA's lengths
    assert ops.count("MatMul") == 5 * layers + 1
    assert set(ops) <= {
        "MatMul",
        "GroupQueryAttention",
        "SkipSimplifiedLayerNormalization",
        "RMSNormalization",
        "Gather",
        "Sigmoid",
        "Mul",
        "ReduceMax",
        "Add",
        "Cast",
    }


def test_group_query_attention_reads_packed_qkv_and_applies_rope(stateful_graph):
    model = ort_backend.graph_to_onnx(stateful_graph("llama")[0]).model
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa.attribute}
    assert gqa.input[1] == gqa.input[2] == ""  # packed q/k/v in the query input
    assert attrs["do_rotary"] == 1 and gqa.input[7] and gqa.input[8]  # cos/sin caches
    assert gqa.input[3].startswith("cache.k.") and gqa.output[1].startswith("present.k.")


def test_node_names_are_namespaced_by_layer(stateful_graph):
    names = [n.name for n in ort_backend.graph_to_onnx(stateful_graph("llama")[0]).model.graph.node]
    assert any(name.startswith("/model/layers.1/") for name in names)
    assert "/model/layers.0/attn/GroupQueryAttention" in names


def test_weights_are_external_data_next_to_the_model(stateful_graph, tmp_path):
    files = ort_backend.write_model(ort_backend.graph_to_onnx(stateful_graph("llama")[0]), tmp_path)
    assert files == ["model.onnx", "model.onnx.data"]
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(
        e.value == "model.onnx.data" for t in external for e in t.external_data if e.key == "location"
    )
    assert (tmp_path / "model.onnx").stat().st_size < (tmp_path / "model.onnx.data").stat().st_size


# -- running it -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, contrib_ops", [(arch, True) for arch in ARCHITECTURES] + [("gpt2", False), ("gemma3", False)]
)  # plain ONNX: layer norm, GELU; windows, softcap, q/k norms
def test_logits_equal_the_reference_interpreter_across_prefill_and_decode(stateful_graph, arch, contrib_ops):
    graph, _ = stateful_graph(arch)
    executable = ort_backend.lower(graph, OPTIONS, contrib_ops=contrib_ops)
    oracle = reference.lower(graph, OPTIONS)
    for tokens, positions in feeds_in_steps():
        expected = oracle.run(tokens, positions)
        torch.testing.assert_close(executable.run(tokens, positions), expected, atol=1e-4, rtol=1e-4)


def test_one_session_updates_the_kv_buffers_in_place(stateful_graph):
    graph, _ = stateful_graph("llama")
    executable = ort_backend.lower(graph, OPTIONS)
    assert all(c["in_place"] for c in executable.info["caches"])
    session, buffers = executable.session, [c.data_ptr() for c in executable.caches]
    oracle = reference.lower(graph, OPTIONS)
    for tokens, positions in feeds_in_steps()[:4]:
        executable.run(tokens, positions)
        oracle.run(tokens, positions)
    assert executable.session is session and [c.data_ptr() for c in executable.caches] == buffers
    for mine, expected in zip(executable.caches, oracle.caches):  # slots 0..14 of both rows were written
        torch.testing.assert_close(mine[:, :, :15], expected[:, :, :15], atol=1e-5, rtol=1e-5)
    executable.reset()
    assert all(not c.any() for c in executable.caches)


def test_logits_written_into_a_reused_buffer_equal_fresh_ones(stateful_graph):
    """Decode steps write into one buffer (`out=`), bound once; feeds alternate shapes in between."""
    graph, _ = stateful_graph("llama")
    executable = ort_backend.lower(graph, OPTIONS)
    oracle = reference.lower(graph, OPTIONS)
    buffers = {}
    for tokens, positions in feeds_in_steps():
        expected = oracle.run(tokens, positions)
        out = buffers.setdefault(tuple(tokens.shape), executable.logits_buffer(*tokens.shape))
        logits = executable.run(tokens, positions, out=out)
        assert logits.data_ptr() == out.data_ptr()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ort_backend.FeedError, match="out must be"):
        executable.run(torch.ones(1, 1, dtype=torch.int64), torch.tensor([[20]]), out=torch.empty(1, 1, 3))


def test_positions_that_are_not_contiguous_are_refused(stateful_graph):
    executable = ort_backend.lower(stateful_graph("llama")[0], OPTIONS)
    with pytest.raises(ort_backend.FeedError, match="contiguous"):
        executable.run(torch.ones(1, 3, dtype=torch.int64), torch.tensor([[0, 2, 3]]))


def test_an_op_the_provider_cannot_run_is_a_compile_time_error_naming_it():
    graph = Graph()
    graph.add_symbol("batch", 1, 2)
    graph.add_symbol("seq", 1, 8)
    tokens = graph.add_input("tokens", TensorType.parse("i64[batch, seq]"))
    graph.add_input("positions", TensorType.parse("i64[batch, seq]"))
    table = graph.add_param("table", torch.randn(16, 4, dtype=torch.float16))
    graph.outputs = [graph.call("erf", graph.call("embedding", table, tokens), name="logits")]
    with pytest.raises(ort_backend.ProviderError, match=r"CPUExecutionProvider cannot run: Erf .*float16"):
        ort_backend.lower(graph, BackendOptions(max_batch=2, max_seq_len=8))


def test_f32_attention_for_cuda_stays_in_plain_ops_updated_in_place(stateful_graph):
    """CUDA's GroupQueryAttention takes no f32 (ORT would place it on the CPU, breaking the KV
    buffers on the device): f32 attention for CUDA lowers to plain ops, whose ScatterND cache
    writes are bound in place; the norms still go to ORT's fused kernels."""
    program = ort_backend.graph_to_onnx(stateful_graph("llama")[0], provider="CUDAExecutionProvider")
    ops = program.op_types()
    assert "GroupQueryAttention" not in ops and ops.count("ScatterND") == 4
    assert "SkipSimplifiedLayerNormalization" in ops
    assert all(c["in_place"] for c in program.info["caches"]) and not program.info["contiguous_positions"]
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        compiled = ort_backend.lower(
            stateful_graph("llama")[0], BackendOptions(max_batch=2, max_seq_len=128, device="cuda")
        )
        assert isinstance(compiled, ort_backend.OrtModelForAnotherMachine)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_plain_scatter_caches_are_updated_in_place_without_a_copy(stateful_graph, arch):
    """A ScatterND cache write bound to its own buffer: the same buffers before and after, the
    same logits and cache contents as the interpreter's, nothing copied back."""
    graph, _ = stateful_graph(arch)
    executable = ort_backend.lower(graph, OPTIONS, contrib_ops=False)
    assert all(c["in_place"] for c in executable.info["caches"]) and not executable._copied_back
    buffers = [c.data_ptr() for c in executable.caches]
    oracle = reference.lower(graph, OPTIONS)
    for tokens, positions in feeds_in_steps():
        torch.testing.assert_close(
            executable.run(tokens, positions), oracle.run(tokens, positions), atol=1e-4, rtol=1e-4
        )
    assert [c.data_ptr() for c in executable.caches] == buffers
    for mine, expected in zip(executable.caches, oracle.caches):
        torch.testing.assert_close(mine[:, :, :23], expected[:, :, :23], atol=1e-5, rtol=1e-5)


def test_without_a_readable_registry_f32_group_query_attention_is_refused_on_cuda(stateful_graph, monkeypatch):
    """onnxruntime-gpu's registry can crash its reader; the known CUDA constraint still holds: an
    f32 GroupQueryAttention would be placed on the CPU, which breaks the in-place KV buffers."""
    from kiln.backends.onnxruntime import providers

    executable = ort_backend.lower(stateful_graph("llama")[0], OPTIONS)
    model = onnx.load(str(executable.model_path), load_external_data=False)
    monkeypatch.setattr(providers, "_kernels", lambda provider: None)
    with pytest.raises(ort_backend.ProviderError, match=r"CUDAExecutionProvider cannot run: GroupQueryAttention.*f16"):
        providers.check_supported(model, "CUDAExecutionProvider")
    providers.check_supported(model, "CPUExecutionProvider")  # nothing known against the CPU


def test_an_f16_model_for_cuda_compiles_on_a_machine_without_one(tiny_model_dirs, tmp_path):
    """f16 is the GPU path: the artifact compiles here (checked against what is known of CUDA's
    kernels), loads where onnxruntime-gpu is, and is refused on this CPU with the reason."""
    path = kiln.compile(
        str(tiny_model_dirs("llama")),
        out=tmp_path / "f16.kiln",
        backend="onnxruntime",
        max_seq_len=OPTIONS.max_seq_len,
        max_batch=OPTIONS.max_batch,
        dtype="f16",
        device="cuda",
    )
    options = json.loads((path / "manifest.json").read_text())["options"]
    assert (options["dtype"], options["device"]) == ("f16", "cuda")
    model = onnx.load(str(path / "model.onnx"), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]
    }
    types.update({t.name: t.data_type for t in model.graph.initializer})
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    attention = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 2 and all(types[n.input[0]] == f16 and types[n.input[3]] == f16 for n in attention)
    # its sequence lengths are fed from the host (computed in the graph, CUDA's kernel goes wrong)
    assert {n.input[5] for n in attention} <= {i.name for i in model.graph.input}
    assert {types[n.input[1]] for n in model.graph.node if n.op_type == "MatMul"} == {f16}
    assert sum(n.op_type == "SkipSimplifiedLayerNormalization" for n in model.graph.node) == 4
    assert types["logits"] == f32  # the runtime's contract, whatever the compute dtype
    with pytest.raises(ort_backend.ProviderError, match=r"CUDAExecutionProvider is not available.*gpu extra"):
        kiln.load(path)
    with pytest.raises(ort_backend.ProviderError, match=r"CPUExecutionProvider cannot run: .*MatMul.*float16"):
        kiln.load(path, device="cpu")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_f16_graph_follows_hugging_face_in_f16_through_the_kv_cache(tiny_model_dirs, arch):
    """What an f16 artifact computes (its stateful graph, run by the reference interpreter) against
    Hugging Face running the same checkpoint in f16: prompt, then decode steps teacher-forced."""
    options = BackendOptions(max_batch=1, max_seq_len=OPTIONS.max_seq_len, dtype="f16")
    graph = run_pipeline(
        capture_causal_lm(
            load_model(tiny_model_dirs(arch)).model, max_batch=1, max_seq_len=options.max_seq_len, dtype=torch.float16
        ),
        options,
    )
    hf = load_model(tiny_model_dirs(arch)).model.to(torch.float16)
    sequence = prompts([20])[0]
    with torch.no_grad():
        expected = hf(torch.tensor([sequence])).logits[0].float()
    executable = reference.lower(graph, options)
    got = [executable.run(torch.tensor([sequence[:12]]), torch.arange(12)[None])[0]]
    got += [executable.run(torch.tensor([[t]]), torch.tensor([[12 + i]]))[0] for i, t in enumerate(sequence[12:])]
    # f16 rounds to ~3 significant digits; logits here are O(1-10)
    torch.testing.assert_close(torch.cat(got), expected, atol=0.06, rtol=0.01)
    assert torch.equal(torch.cat(got).argmax(-1), expected.argmax(-1))


# -- artifacts and generation ---------------------------------------------------------------
@pytest.mark.parametrize("kv_layout", ["static", "paged"])
def test_compiled_artifact_lists_the_model_and_its_data_with_hashes_and_loads_back(
    tiny_model_dirs, tmp_path, kv_layout
):
    path = kiln.compile(
        str(tiny_model_dirs("llama")),
        out=tmp_path / "model.kiln",
        backend="onnxruntime",
        max_seq_len=OPTIONS.max_seq_len,
        max_batch=OPTIONS.max_batch,
        kv_layout=kv_layout,
        kv_block_size=16,
    )
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["backend"] == "onnxruntime"
    assert all(len(manifest["files"][f]["sha256"]) == 64 for f in ("model.onnx", "model.onnx.data"))
    llm = kiln.load(path)
    assert isinstance(llm.executable, ort_backend.OrtExecutable)
    assert llm.executable.model_path.parent == path  # runs the artifact's own files: no lowering at load
    assert (llm.engine.paged is not None) == (kv_layout == "paged")  # the engine schedules the pool's blocks
    (prompt,) = prompts([6], seed=3)
    model = load_model(tiny_model_dirs("llama")).model
    assert llm.generate(prompt, max_new_tokens=16).token_ids == hf_greedy(model, prompt, 16, eos_ids(llm))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_of_one_equals_hugging_face(llms, arch):
    llm, model = llms(arch)
    (prompt,) = prompts([9])
    assert llm.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(
        model, prompt, NEW_TOKENS, eos_ids(llm)
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_of_two_prompt_lengths_equals_hugging_face(llms, arch):
    llm, model = llms(arch)
    batch = prompts([5, 12], seed=1)
    for prompt, result in zip(batch, llm.generate(batch, max_new_tokens=NEW_TOKENS)):
        assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS, eos_ids(llm))


@pytest.mark.slow
def test_real_smollm2_greedy_equals_hugging_face_batch_one_and_two(smollm2_dir, tmp_path):
    path = kiln.compile(
        str(smollm2_dir), out=tmp_path / "smollm2.kiln", backend="onnxruntime", max_seq_len=256, max_batch=2
    )
    llm = kiln.load(path)
    model = load_model(smollm2_dir).model
    question = llm.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    other = llm.tokenizer.encode("The quick brown fox")
    results = llm.generate([question, other], max_new_tokens=NEW_TOKENS)
    for prompt, result in zip([question, other], results):
        assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS, eos_ids(llm))
    assert "Paris" in results[0].text
    assert llm.generate(question, max_new_tokens=NEW_TOKENS).token_ids == results[0].token_ids


# -- quantized weights ----------------------------------------------------------------------
def quantized_graph(bits: int, group_size: int, with_zeros: bool) -> Graph:
    """tokens -> embedding_q -> linear_q -> logits, with random codes, scales and zero points."""
    quantized = pytest.importorskip("kiln.ir.ops.quantized")
    g = torch.Generator().manual_seed(bits * 100 + group_size)
    vocab, k, n = 32, 96, 48

    def weight(rows):
        groups = quantized.group_count(k, group_size)
        if bits == 4:
            codes = quantized.pack_int4(torch.randint(0, 16, (rows, k), generator=g))
        else:
            codes = torch.randint(-127, 128, (rows, k), generator=g, dtype=torch.int8)
        zeros = torch.randint(0, 16, (rows, groups), generator=g, dtype=torch.uint8) if with_zeros else None
        return codes, torch.rand(rows, groups, generator=g) * 0.1 + 0.01, zeros

    graph = Graph()
    graph.add_symbol("batch", 1, 2)
    graph.add_symbol("seq", 1, 8)
    tokens = graph.add_input("tokens", TensorType.parse("i64[batch, seq]"))
    graph.add_input("positions", TensorType.parse("i64[batch, seq]"))
    attrs = {"bits": bits, "group_size": group_size}
    params = [
        [
            graph.add_param(f"{name}.{part}", t) if t is not None else None
            for part, t in zip(("q", "scales", "zeros"), weight(rows))
        ]
        for name, rows in (("embed", vocab), ("head", n))
    ]
    (eq, es, ez), (hq, hs, hz) = params
    x = graph.call("embedding_q", eq, es, tokens, ez, **attrs)
    graph.outputs = [graph.call("linear_q", x, hq, hs, hz, None, name="logits", **attrs)]
    return graph


@pytest.mark.parametrize(
    "bits, group_size, with_zeros",
    [(4, 32, True), (4, 48, False), (8, 96, False), (4, 6, True)],
    ids=["int4-g32-zeros", "int4-g48", "int8-per-channel", "int4-g6-dequantized"],
)
def test_quantized_weights_run_as_matmulnbits_and_equal_the_interpreter(
    bits, group_size, with_zeros, exact_activations
):
    graph = quantized_graph(bits, group_size, with_zeros)
    options = BackendOptions(max_batch=2, max_seq_len=8)
    ops = ort_backend.graph_to_onnx(graph).op_types()
    assert ("MatMulNBits" in ops) == (group_size % 16 == 0)
    tokens = torch.randint(0, 32, (2, 5))
    positions = torch.arange(5).expand(2, 5)
    expected = reference.lower(graph, options).run(tokens, positions)
    torch.testing.assert_close(ort_backend.lower(graph, options).run(tokens, positions), expected, atol=1e-4, rtol=1e-4)


def test_matmulnbits_rounds_activations_to_int8_by_default_and_stays_close_to_the_interpreter():
    """Accuracy level 4 (the default, ORT's fast CPU path): an approximation of the exact result."""
    graph = quantized_graph(4, 32, False)
    options = BackendOptions(max_batch=2, max_seq_len=8)
    model = ort_backend.graph_to_onnx(graph).model
    levels = {
        a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"
    }
    assert levels == {4}
    tokens, positions = torch.randint(0, 32, (2, 5)), torch.arange(5).expand(2, 5)
    expected = reference.lower(graph, options).run(tokens, positions)
    got = ort_backend.lower(graph, options).run(tokens, positions)
    assert not torch.equal(got, expected)  # the activations were rounded
    assert float((got - expected).norm() / expected.norm()) < 0.05


def test_int4_pipeline_runs_as_matmulnbits_and_gatherblockquantized(stateful_graph, exact_activations):
    _, model = stateful_graph("llama")
    options = BackendOptions(max_batch=2, max_seq_len=128, quantize="int4-g32", quantize_embeddings=True)
    graph = run_pipeline(capture_causal_lm(model, max_batch=2, max_seq_len=128), options)
    ops = ort_backend.graph_to_onnx(graph).op_types()
    assert "GatherBlockQuantized" in ops and "MatMulNBits" in ops and "MatMul" not in ops
    executable, oracle = ort_backend.lower(graph, options), reference.lower(graph, options)
    for tokens, positions in feeds_in_steps()[:3]:
        expected = oracle.run(tokens, positions)
        torch.testing.assert_close(executable.run(tokens, positions), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma3"])  # plain attention; GQA; softcapped logits
def test_last_only_logits_equal_the_last_position_of_the_full_ones(stateful_graph, arch):
    """The lm_head runs on the selected positions only (a Gather before it): a prompt's last
    logits, as the engine asks for them, equal those the full run computes."""
    graph, _ = stateful_graph(arch)
    full, last = ort_backend.lower(graph, OPTIONS), ort_backend.lower(graph, OPTIONS)
    assert last.selects_logits
    for tokens, positions in feeds_in_steps():
        expected = full.run(tokens, positions)
        got = last.run(tokens, positions, last_only=True)
        assert got.shape == (tokens.size(0), 1, expected.size(-1))
        torch.testing.assert_close(got, expected[:, -1:], atol=1e-5, rtol=1e-5)


def test_the_engine_asks_for_a_prompts_last_logits_only(stateful_graph):
    graph, _ = stateful_graph("llama")
    executable = ort_backend.lower(graph, OPTIONS)
    calls = []
    run = executable.run

    def recording_run(tokens, positions, *args, **kwargs):
        calls.append((tokens.size(1), kwargs.get("last_only", False)))
        return run(tokens, positions, *args, **kwargs)

    executable.run = recording_run
    reference_tokens = LLM(reference.lower(graph, OPTIONS)).generate([5, 6, 7, 8, 9], max_new_tokens=4).token_ids
    assert LLM(executable).generate([5, 6, 7, 8, 9], max_new_tokens=4).token_ids == reference_tokens
    assert calls[0] == (5, True) and all(seq == 1 for seq, _ in calls[1:])


def test_a_model_computing_attention_lengths_in_the_graph_is_refused_off_the_cpu(stateful_graph):
    """Artifacts from before the lengths were inputs: right on the CPU, wrong on CUDA, so refused there."""
    from kiln.backends.onnxruntime import providers

    executable = ort_backend.lower(stateful_graph("llama")[0], OPTIONS)
    model = onnx.load(str(executable.model_path), load_external_data=False)
    old_info = {**executable.info, "inputs": ["tokens", "positions"]}
    providers.check_lengths_fed(model, executable.info, "CUDAExecutionProvider")  # lengths fed: fine
    providers.check_lengths_fed(model, old_info, "CPUExecutionProvider")
    with pytest.raises(ort_backend.ProviderError, match="sequence lengths in the graph.*compile it again"):
        providers.check_lengths_fed(model, old_info, "CUDAExecutionProvider")
