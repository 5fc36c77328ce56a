"""The tinygrad backend: IR -> tinygrad Tensors under TinyJit, checked against the interpreter and
Hugging Face.

tinygrad compiles every kernel with clang on first use, so each model is compiled once per module
and shared; BEAM search is left off (it belongs to the benchmarks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import kiln
from hf_oracle import eos_ids, hf_greedy, prompts
from kiln.backends.executable import BackendOptions
from kiln.frontend.checkpoint import load_model
from kiln.ir import run_graph
from kiln.runtime.artifact import read_artifact

tinygrad_backend = pytest.importorskip("kiln.backends.tinygrad")
from kiln.backends.tinygrad import (  # noqa: E402
    CompilerNotFoundError,
    FeedError,
    TinygradArtifactError,
    check_lowering_table,
    compiled_program_count,
    toolchain,
)
from kiln.backends.tinygrad.graph_to_tensors import LoweringContext, graph_to_tensors  # noqa: E402
from kiln.backends.tinygrad.toolchain import CLANG_INSTALL, configure_cpu_device  # noqa: E402

# The catalogue of one small graph per IR op, shared with the inductor backend's tests.
from test_inductor_backend import OP_CASES, build_op_graph, random_feeds  # noqa: E402

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def compiled(tiny_model_dirs, tmp_path_factory):
    """arch -> (artifact path, loaded LLM, HF model), compiled and loaded once per module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            source = tiny_model_dirs(arch)
            path = kiln.compile(
                str(source),
                out=tmp_path_factory.mktemp(arch) / "model.kiln",
                backend="tinygrad",
                max_seq_len=64,
                max_batch=2,
            )
            cache[arch] = path, kiln.load(path), load_model(source).model
        return cache[arch]

    return get


def test_every_registered_op_has_a_tinygrad_lowering():
    check_lowering_table()


def test_all_ops_match_the_interpreter():
    """Every op case in one graph (one eager tinygrad run), caches as plain inputs: the generic
    kv_write and attention forms, as the IR defines them (an int8 KV cache is refused instead)."""
    cases = {name: case for name, case in OP_CASES.items() if name != "kv_quantize"}
    graph = build_op_graph(cases)
    feeds = random_feeds(graph, cases, batch=2, seq=3)
    expected = run_graph(graph, [f.clone() for f in feeds])
    from tinygrad import Tensor

    tensors = {v.name: Tensor(f.numpy()) for v, f in zip(graph.inputs, feeds)}
    actual = graph_to_tensors(graph, tensors, LoweringContext({"batch": 2, "seq": 3}))
    Tensor.realize(*actual)  # one schedule for every output
    for value, e, a in zip(graph.outputs, expected, actual):
        result = torch.from_numpy(a.numpy())
        assert result.dtype == e.dtype and result.shape == e.shape, value.name
        torch.testing.assert_close(result, e, atol=1e-5, rtol=1e-5, msg=lambda m, name=value.name: f"{name}: {m}")


@pytest.mark.parametrize(
    "bits, group_size, symmetric, k",
    [(8, 128, True, 128), (4, 32, True, 128), (4, 64, False, 192), (4, 128, True, 256), (4, 16, False, 96)],
)
@pytest.mark.parametrize("packed", [False, True])
def test_linear_q_in_both_forms_matches_the_interpreter(bits, group_size, symmetric, k, packed):
    """Up to 8 rows take the grouped form (sums on the codes, scaled per group), more rows, or a
    K the groups do not divide, the dequantize-then-multiply form; both are f32 arithmetic, on
    linear_q's layout and on the codes packed into 32-bit words (packed_codes.py)."""
    from tinygrad import Context, Tensor

    from kiln.backends.tinygrad.executable import to_tinygrad
    from kiln.backends.tinygrad.kernel_opts import install_kernel_opts
    from kiln.backends.tinygrad.quantized_lowerings import takes_grouped_form
    from kiln.backends.tinygrad.weight_layouts import WeightLayouts, plan_weights, stored_weight
    from test_quantization import quantized_linear_graph

    install_kernel_opts()
    graph = quantized_linear_graph(bits, group_size, symmetric, k)
    layouts = plan_weights(graph) if packed else WeightLayouts({})
    assert (layouts.packed_bits(graph.params["w.q"]) == bits) == packed
    weights = {name: to_tinygrad(stored_weight(name, value, layouts)) for name, value in graph.weights.items()}
    for rows in (1, 3, 12):
        x = torch.randn(rows, k)
        assert takes_grouped_form(Tensor(x.numpy()), group_size) == (rows <= 8)
        want = run_graph(graph, [x])[0]
        context = LoweringContext({"rows": rows}, layouts=layouts)
        with Context(PARALLEL=0):  # kernel_opts' hook lives in this process only
            got = graph_to_tensors(graph, {"x": Tensor(x.numpy()), **weights}, context)[0].numpy()
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_batch_of_one_equals_hugging_face(compiled, arch):
    _, llm, model = compiled(arch)
    (prompt,) = prompts([9])
    result = llm.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS, eos_ids(llm))


def test_greedy_batch_of_two_prompt_lengths_equals_hugging_face(compiled):
    """Rows at different positions: one start Variable per row."""
    _, llm, model = compiled("llama")
    batch = prompts([5, 12], seed=1)
    results = llm.generate(batch, max_new_tokens=12)
    for prompt, result in zip(batch, results):
        assert result.token_ids == hf_greedy(model, prompt, 12, eos_ids(llm))


def test_decoding_compiles_no_kernel_after_the_first_steps(compiled):
    _, llm, _ = compiled("gpt2")
    executable = llm.executable
    llm.generate(prompts([7], seed=3)[0], max_new_tokens=4, ignore_eos=True)
    programs, jits = compiled_program_count(), dict(executable.jits)
    llm.generate(prompts([7], seed=4)[0], max_new_tokens=40, ignore_eos=True)
    assert compiled_program_count() == programs
    assert executable.jits == jits  # the same two TinyJits (prefill, decode), replayed
    decode = executable.jits[(1, "decode")]
    assert decode.captured is not None and decode.cnt > 40


def test_steps_replay_from_native_code_with_greedy_equal_to_hugging_face(compiled, monkeypatch):
    """Every step's kernels run from native_replay.c's loop (split kernels on its threads), not
    from the Python fallback, and the tokens are still Hugging Face's."""
    from kiln.backends.tinygrad.cpu_graph import KernelLaunch, NativeLaunches

    native_calls = []
    run = NativeLaunches.run
    monkeypatch.setattr(NativeLaunches, "run", lambda self, *a: (native_calls.append(1), run(self, *a))[1])
    monkeypatch.setattr(KernelLaunch, "prepare", lambda *a: pytest.fail("a step replayed from Python"))
    _, llm, model = compiled("llama")
    (prompt,) = prompts([6], seed=5)
    result = llm.generate(prompt, max_new_tokens=8)
    assert result.token_ids == hf_greedy(model, prompt, 8, eos_ids(llm))
    assert len(native_calls) >= len(result.token_ids)


def test_artifact_lists_its_tinygrad_file_and_reloads(compiled, tmp_path):
    path, llm, _ = compiled("gpt2")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["backend"] == "tinygrad" and "tinygrad.json" in manifest["files"]
    info = json.loads((path / "tinygrad.json").read_text())
    assert info["tinygrad"] == tinygrad_backend.backend_version() and info["prefill_chunk"] >= 2
    reloaded = kiln.load(path)  # rebuilt from graph.kir + weights + tinygrad.json, no frontend
    (prompt,) = prompts([6], seed=2)
    assert reloaded.generate(prompt, max_new_tokens=6).token_ids == llm.generate(prompt, max_new_tokens=6).token_ids


def test_an_artifact_from_another_tinygrad_version_is_refused(compiled, tmp_path):
    path, _, _ = compiled("gpt2")
    info = json.loads((path / "tinygrad.json").read_text())
    (tmp_path / "tinygrad.json").write_text(json.dumps({**info, "tinygrad": "0.1.0"}))
    graph = read_artifact(path).graph
    with pytest.raises(TinygradArtifactError, match="tinygrad 0.1.0"):
        tinygrad_backend.load(tmp_path, graph, graph.weights, BackendOptions(max_seq_len=64))


def test_run_rejects_positions_that_are_not_consecutive(compiled):
    _, llm, _ = compiled("llama")
    with pytest.raises(FeedError, match="consecutive"):
        llm.executable.run(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 2, 3]]))
    with pytest.raises(FeedError, match="positions must lie"):
        llm.executable.run(torch.tensor([[5]]), torch.tensor([[64]]))


def test_cache_views_are_made_only_for_calls_that_read_them(compiled, monkeypatch):
    """A decode from row 0 makes no torch views of the caches (~1.3 ms for SmolLM2's 60); a call
    at row 1 swaps through them, made once, and gives row 0's logits for the same tokens."""
    _, llm, _ = compiled("llama")
    executable = llm.executable
    made = []
    cache_views = executable.cache_views
    monkeypatch.setattr(executable, "cache_views", lambda: made.append(1) or cache_views())
    executable.reset()
    tokens, positions = torch.tensor([[5, 6, 7, 8]]), torch.arange(4)[None]
    at_row_0 = executable.run(tokens, positions)
    executable.run(torch.tensor([[9]]), torch.tensor([[4]]))
    assert made == []
    at_row_1 = executable.run(tokens, positions, first_row=1)
    assert made == [1]
    torch.testing.assert_close(at_row_1, at_row_0, rtol=0, atol=0)


def test_a_missing_c_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/clang")
    with pytest.raises(CompilerNotFoundError, match="clang") as error:
        configure_cpu_device()
    assert CLANG_INSTALL in str(error.value)
    monkeypatch.setenv("CC", "gcc")
    with pytest.raises(CompilerNotFoundError, match="unset CC"):
        configure_cpu_device()


def test_the_newest_versioned_clang_compiles_and_keys_the_cache(monkeypatch, tmp_path):
    """Without $CC the newest clang-NN on PATH is chosen over plain clang; tinygrad's compiles run
    it (a wrapper on PATH records each call) and its disk cache is keyed by its name."""
    from tinygrad.runtime.support.compiler_cpu import ClangCompiler

    real = shutil.which(toolchain.cpu_compiler()) or pytest.skip("no clang")
    calls = tmp_path / "calls"
    for name in ("clang-20", "clang-21"):  # clang-21 is the newest: chosen
        wrapper = tmp_path / name
        wrapper.write_text(f'#!/bin/sh\necho {name} >> {calls}\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CC", raising=False)
    assert toolchain.cpu_compiler() == "clang-21"
    toolchain.install_chosen_compiler()
    compiler = ClangCompiler(["x86_64", "native"])
    assert "clang-21" in compiler.cachekey
    obj = compiler.compile("int kiln_probe(int a) { return a + 1; }")
    assert obj[:4] == b"\x7fELF"
    assert calls.read_text().split() == ["clang-21"]
    monkeypatch.setenv("CC", real)  # $CC still wins
    assert toolchain.cpu_compiler() == real


def test_a_kernel_compiles_without_warnings_on_the_terminal(capfd):
    """-march=native on an AVX10 Xeon made clang 19 warn once per kernel (feature promotion)."""
    from tinygrad.runtime.support.compiler_cpu import ClangCompiler

    shutil.which(toolchain.cpu_compiler()) or pytest.skip("no clang")
    toolchain.install_chosen_compiler()
    obj = ClangCompiler(["x86_64", "native"]).compile("float kiln_probe(float a) { return a * 2.0f; }")
    assert obj[:4] == b"\x7fELF"
    assert capfd.readouterr().err == ""


WITH_ONE_VERSIONED_CLANG = """
import json
import kiln.backends.tinygrad
from tinygrad import Tensor

x = Tensor.arange(96).reshape(8, 12).float()
parts = [(x @ x.T).relu().sum(1) + x.max(1), *(x * i for i in range(2, 5))]
Tensor.realize(*parts)  # several kernels at once: a parallel compile where tinygrad may
print(json.dumps([part.tolist() for part in parts]))
"""


def test_tinygrad_compiles_where_a_versioned_clang_is_the_only_one(tmp_path):
    """A machine with clang-19 and no plain `clang` (what `make clang` installs on a bare Debian):
    importing Kiln's backend is enough for tinygrad to open its CPU device and compile several
    kernels, all in this process (its spawned compile workers would run plain `clang`)."""
    real = shutil.which(toolchain.cpu_compiler()) or pytest.skip("no clang")
    (tmp_path / "clang-19").symlink_to(real)
    env = {**os.environ, "PATH": str(tmp_path), "CCACHE": "0"}
    env.pop("CC", None)
    done = subprocess.run([sys.executable, "-c", WITH_ONE_VERSIONED_CLANG], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    x = np.arange(96, dtype=np.float32).reshape(8, 12)
    want = [np.maximum(x @ x.T, 0).sum(1) + x.max(1), *(x * i for i in range(2, 5))]
    assert json.loads(done.stdout) == [part.tolist() for part in want]


@pytest.mark.slow
def test_real_smollm2_greedy_equals_hugging_face(smollm2_dir, tmp_path):
    path = kiln.compile(str(smollm2_dir), out=tmp_path / "smollm2.kiln", backend="tinygrad", max_seq_len=128)
    llm = kiln.load(path)
    model = load_model(smollm2_dir).model
    question = llm.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = llm.generate(question, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == hf_greedy(model, question, NEW_TOKENS, eos_ids(llm))
    assert "Paris" in result.text


def test_prompt_pieces_fixed_and_symbolic_match_hugging_face(compiled):
    """40 tokens run as a fixed chunk of 32 at position 0 (its own keys, fixed shapes) and 8 at a
    symbolic length; 20 more at position 40 as a short fixed chunk of 16 and 4 in the chunk of 8
    padded; last_only keeps the last row. Then 8 tokens, and a fixed chunk of 32 at the symbolic
    start 8."""
    _, llm, model = compiled("llama")
    executable = llm.executable
    tokens = torch.tensor(prompts([60], seed=5))
    want = model(input_ids=tokens).logits.float()
    executable.reset()
    first = executable.run(tokens[:, :40], torch.arange(40)[None])
    last = executable.run(tokens[:, 40:], torch.arange(40, 60)[None], last_only=True)
    assert executable._chunk_plan(40, at_zero=True) == [(32, 32), (8, None)]
    assert executable._chunk_plan(20) == [(16, 16), (4, 8)] and executable._chunk_plan(20, True) == [(20, None)]
    assert executable._chunk_plan(20, room=23) == [(16, 16), (4, None)]  # no 8 slots left after the 16
    torch.testing.assert_close(first, want[:, :40], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(last, want[:, 59:], atol=2e-4, rtol=2e-4)
    executable.reset()
    executable.run(tokens[:, :8], torch.arange(8)[None])
    later = executable.run(tokens[:, 8:40], torch.arange(8, 40)[None])
    fixed = {key for key in executable.jits if "fixed" in key}
    assert fixed == {(1, "fixed", 32, "at_zero"), (1, "fixed", 32), (1, "fixed", 16, "last"), (1, "fixed", 8, "last")}
    torch.testing.assert_close(later, want[:, 8:40], atol=2e-4, rtol=2e-4)


def test_every_step_length_at_a_symbolic_start_matches_hugging_face(compiled):
    """M = 1..16 tokens after a 9-token prompt (decode; 2-3 at a symbolic length, 4-7 in the chunk
    of 8 padded; 8; 9-15 in the chunk of 16 padded; 16): every position's logits are Hugging Face's. A
    padded call at row 1 leaves row 0's keys past its tokens as they were (the padding's slots
    are put back), and near the end of the cache, where 8 slots do not fit, the tail runs at a
    symbolic length."""
    _, llm, model = compiled("llama")
    executable = llm.executable
    tokens = torch.tensor(prompts([64], seed=7))
    want = model(input_ids=tokens).logits.float()
    for m in range(1, 17):
        executable.reset()
        executable.run(tokens[:, :9], torch.arange(9)[None])
        got = executable.run(tokens[:, 9 : 9 + m], torch.arange(9, 9 + m)[None])
        torch.testing.assert_close(got, want[:, 9 : 9 + m], atol=2e-4, rtol=2e-4, msg=f"M = {m}")
    assert {(1, "fixed", 8), (1, "fixed", 16)} <= set(executable.jits)
    executable.reset()
    executable.run(tokens[:, :40], torch.arange(40)[None])  # row 0: keys in slots 0..39
    row0 = [view[0, :, :40].clone() for view in executable.cache_views()]
    executable.run(tokens[:, :9], torch.arange(9)[None], first_row=1)
    got = executable.run(tokens[:, 9:13], torch.arange(9, 13)[None], first_row=1)  # pads slots 13..16
    torch.testing.assert_close(got, want[:, 9:13], atol=2e-4, rtol=2e-4)
    assert all(torch.equal(view[0, :, :40], kept) for view, kept in zip(executable.cache_views(), row0))
    assert executable.pad_from == 4 and executable._chunk_plan(3) == [(3, None)]
    assert executable._chunk_plan(5) == [(5, 8)] and executable._chunk_plan(5, room=64 - 58) == [(5, None)]
    assert executable._chunk_plan(12) == [(12, 16)] and executable._chunk_plan(12, room=14) == [(8, 8), (4, None)]
    executable.run(tokens[:, :58], torch.arange(58)[None])
    got = executable.run(tokens[:, 58:63], torch.arange(58, 63)[None])
    torch.testing.assert_close(got, want[:, 58:63], atol=2e-4, rtol=2e-4)


def test_chunk_attention_in_query_blocks_equals_grouped_attention():
    """A chunk at position 0 attends in blocks of 128 queries over keys laid out as product
    weights (cache_attention.chunk_attention): the same as the plain grouped form, with a sliding
    window and soft-capping too."""
    from tinygrad import Tensor, dtypes

    from kiln.backends.tinygrad.cache_attention import chunk_attention, grouped_attention

    rng = np.random.default_rng(0)
    q, k, v = (Tensor(rng.standard_normal((1, heads, 144, 16), dtype=np.float32)) for heads in (4, 2, 2))
    hidden = Tensor.ones(144, 144, dtype=dtypes.bool).triu(1) | Tensor.ones(144, 144, dtype=dtypes.bool).tril(-40)
    want = grouped_attention(q, k, v, hidden, None, 0.25, 30.0).numpy()
    np.testing.assert_allclose(chunk_attention(q, k, v, 0.25, 30.0, 40).numpy(), want, atol=1e-5, rtol=1e-5)


def test_vector_exp_equals_tinygrads_exp2_bit_for_bit(monkeypatch):
    """vector_exp.py: a float32 exp2 renders as one inline function, its kernel's contiguous
    axis upcast by 16, and gives the floats of tinygrad's own decomposition (TRANSCENDENTAL=2
    forces it), infinities, NaN and the clamped ends included."""
    from tinygrad import Context, Tensor
    from tinygrad.runtime.support.compiler_cpu import ClangCompiler

    from kiln.backends.tinygrad.vector_exp import EXP2_FUNCTION, install_vector_exp

    install_vector_exp()
    sources = []
    compile_cached = ClangCompiler.compile_cached
    monkeypatch.setattr(
        ClangCompiler, "compile_cached", lambda self, src: sources.append(src) or compile_cached(self, src)
    )
    specials = [np.inf, -np.inf, np.nan, 127.99, 128.0, -150.0, -150.01, -151.0, -0.5, 0.5, 0.0, 1e-40]
    values = np.random.default_rng(0).uniform(-200, 200, 3 * 688).astype(np.float32)
    values[: len(specials)] = specials
    with Context(PARALLEL=0):
        ours = (Tensor(values.reshape(3, 688)) * 1.0).exp2().numpy().ravel()
    assert any(EXP2_FUNCTION in src and re.search(r"void E_\w+_16\(", src) for src in sources)  # 16 lanes
    with Context(TRANSCENDENTAL=2):
        theirs = (Tensor(values.reshape(3, 688)) * 1.0).exp2().numpy().ravel()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int4-g32", "int8"])
def test_packed_codes_greedy_equals_the_reference_backend(tiny_model_dirs, tmp_path, scheme):
    """Quantized linears and the tied, quantized embedding and lm_head stored packed into 32-bit
    words (packed_codes.py): greedy equal to the reference backend's artifact of the same scheme
    (the prompt's lm_head for its last position alone, in the grouped form); then 16 tokens at
    position 9, a fixed short chunk whose products over the codes tile 4 rows at a time."""
    source = tiny_model_dirs("llama")
    llms = {}
    for backend in ("tinygrad", "reference"):
        path = kiln.compile(
            str(source),
            out=tmp_path / backend / "model.kiln",
            backend=backend,
            max_seq_len=64,
            quantize=scheme,
            quantize_embeddings=True,
        )
        llms[backend] = kiln.load(path)
    stored = llms["tinygrad"].executable.layouts.stored
    assert {s.packed for s in stored.values()} == {4 if scheme == "int4-g32" else 8, None}
    (prompt,) = prompts([9], seed=2)
    want = llms["reference"].generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
    assert llms["tinygrad"].generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids == want
    tokens = torch.tensor([prompt + want[:16]])
    logits = {}
    for backend, llm in llms.items():
        llm.executable.reset()
        llm.executable.run(tokens[:, :9], torch.arange(9)[None])
        logits[backend] = llm.executable.run(tokens[:, 9:25], torch.arange(9, 25)[None])
    assert (1, "fixed", 16) in llms["tinygrad"].executable.jits
    torch.testing.assert_close(logits["tinygrad"], logits["reference"], atol=1e-3, rtol=1e-3)
    assert llms["tinygrad"].executable.pad_from == 2
    for m in (3, 5, 8, 11):  # the chunks of 8 and 16, padded
        for backend, llm in llms.items():
            llm.executable.reset()
            llm.executable.run(tokens[:, :9], torch.arange(9)[None])
            logits[backend] = llm.executable.run(tokens[:, 9 : 9 + m], torch.arange(9, 9 + m)[None])
        torch.testing.assert_close(logits["tinygrad"], logits["reference"], atol=1e-3, rtol=1e-3, msg=f"M = {m}")
