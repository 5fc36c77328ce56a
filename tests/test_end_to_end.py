"""End to end: compile, load, generate; greedy tokens must equal Hugging Face's, token for token."""

import json
import os
import subprocess
import sys

import pytest

import kiln
from hf_oracle import eos_ids, hf_greedy, prompts
from kiln.frontend.checkpoint import load_model
from tiny_models import ARCHITECTURES

NEW_TOKENS = 64
BACKEND = os.environ.get("KILN_TEST_BACKEND", "inductor")


@pytest.fixture(scope="module")
def compiled(tiny_model_dirs, tmp_path_factory):
    """arch -> (artifact path, HF model), compiled once per module."""
    cache = {}

    def get(arch):
        if arch not in cache:
            source = tiny_model_dirs(arch)
            out = kiln.compile(
                str(source),
                out=tmp_path_factory.mktemp(arch) / "model.kiln",
                backend=BACKEND,
                max_seq_len=128,
                max_batch=2,
            )
            cache[arch] = out, load_model(source).model
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_of_one_equals_hugging_face(compiled, arch):
    path, model = compiled(arch)
    llm = kiln.load(path)
    (prompt,) = prompts([9])
    result = llm.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS, eos_ids(llm))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_batch_of_two_prompt_lengths_equals_hugging_face(compiled, arch):
    path, model = compiled(arch)
    llm = kiln.load(path)
    batch = prompts([5, 12], seed=1)
    results = llm.generate(batch, max_new_tokens=NEW_TOKENS)
    for prompt, result in zip(batch, results):
        assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS, eos_ids(llm))


def test_loaded_artifact_generates_in_a_fresh_process_without_the_frontend(compiled):
    path, _ = compiled("llama")
    (prompt,) = prompts([6], seed=2)
    expected = kiln.load(path).generate(prompt, max_new_tokens=8).token_ids
    script = (
        "import json, sys, kiln\n"
        f"llm = kiln.load({str(path)!r})\n"
        f"ids = llm.generate({prompt!r}, max_new_tokens=8).token_ids\n"
        "loaded = [m for m in sys.modules if m.startswith(('kiln.frontend', 'transformers'))]\n"
        "print(json.dumps({'ids': ids, 'frontend_modules': loaded}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["frontend_modules"] == []
    assert report["ids"] == expected


@pytest.mark.slow
def test_real_smollm2_greedy_equals_hugging_face_and_knows_paris(smollm2_dir, tmp_path):
    path = kiln.compile(str(smollm2_dir), out=tmp_path / "smollm2.kiln", backend=BACKEND, max_seq_len=256, max_batch=2)
    llm = kiln.load(path)
    model = load_model(smollm2_dir).model
    question = llm.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    other = llm.tokenizer.encode("The quick brown fox")
    results = llm.generate([question, other], max_new_tokens=NEW_TOKENS)
    for prompt, result in zip([question, other], results):
        assert result.token_ids == hf_greedy(model, prompt, NEW_TOKENS, eos_ids(llm))
    assert "Paris" in results[0].text
    alone = llm.generate(question, max_new_tokens=NEW_TOKENS)
    assert alone.token_ids == results[0].token_ids


def test_inductor_compilations_do_not_grow_with_generated_tokens(tiny_model_dirs):
    from kiln.backends.executable import BackendOptions
    from kiln.backends.inductor import lower
    from kiln.frontend.capture import capture_causal_lm
    from kiln.passes.pipeline import run_pipeline
    from kiln.runtime.generate import LLM

    options = BackendOptions(max_batch=2, max_seq_len=128)
    graph = run_pipeline(capture_causal_lm(load_model(tiny_model_dirs("llama")).model, 2, 128), options)
    executable = lower(graph, options)
    llm = LLM(executable)
    llm.generate(prompts([7])[0], max_new_tokens=4, ignore_eos=True)
    after_few = executable.compile_count
    llm.generate(prompts([7])[0], max_new_tokens=40, ignore_eos=True)
    llm.generate(prompts([5, 9]), max_new_tokens=20, ignore_eos=True)
    assert after_few <= 2  # prefill (dynamic seq) and decode (seq 1)
    assert executable.compile_count <= after_few + 2  # batch 2 may add its own pair, never one per token
