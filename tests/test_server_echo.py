"""`echo` + `logprobs` on /v1/completions, driven by the `openai` client: the prompt comes back
before the text, with every prompt token's log-probability (the first null) equal to Hugging
Face's log-softmax within 1e-4, in the same format as the generated tokens' log-probabilities."""

from __future__ import annotations

import openai
import pytest
import torch

import kiln
from kiln.frontend.checkpoint import load_model
from kiln.runtime.openai_logprobs import TokenBytes, token_string
from kiln.runtime.server import create_app
from served import served, tiny_llama_artifact

MODEL = "tiny-llama"
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def llm(tiny_model_dirs, tmp_path_factory):
    return kiln.load(tiny_llama_artifact(tiny_model_dirs, tmp_path_factory))


@pytest.fixture(scope="module")
def hf_model(tiny_model_dirs):
    return load_model(tiny_model_dirs("llama")).model


@pytest.fixture(scope="module")
def client(llm):
    with served(create_app(llm, MODEL)) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def hf_log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)


def test_echo_scores_the_prompt_as_hugging_face_does(client, llm, hf_model):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = response.choices[0]
    ids = llm.tokenizer.encode(PROMPT)
    log_probs = hf_log_probs(hf_model, ids)
    assert choice.text == PROMPT
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) == response.usage.prompt_tokens
    assert "".join(logprobs.tokens) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    want = [log_probs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    names = TokenBytes(llm.tokenizer)  # alternatives are named as the generated tokens' are
    for position, top in enumerate(logprobs.top_logprobs[1:]):
        best = log_probs[position].topk(2)
        assert list(top) == [token_string(names.of(token)) for token in best.indices.tolist()]
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
    assert logprobs.text_offset == [len(llm.tokenizer.decode(ids[:i])) for i in range(len(ids))]


def test_echo_with_a_generation_joins_the_prompt_and_the_text_in_one_format(client, llm):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    prompt_tokens = echoed.usage.prompt_tokens
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    ours, theirs = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert ours.tokens[prompt_tokens:] == theirs.tokens
    # (equal up to float rounding: a prompt cached by the request before takes another path)
    assert ours.token_logprobs[prompt_tokens:] == pytest.approx(theirs.token_logprobs, abs=1e-5)
    assert [list(top) for top in ours.top_logprobs[prompt_tokens:]] == [list(top) for top in theirs.top_logprobs]
    assert ours.text_offset[prompt_tokens:] == [len(PROMPT) + offset for offset in theirs.text_offset]
    # scoring the generated text as a prompt gives the log-probabilities generating it did
    ids = llm.tokenizer.encode(PROMPT) + llm.generate(PROMPT, max_new_tokens=6).token_ids
    rescored = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert rescored.choices[0].logprobs.token_logprobs[prompt_tokens:] == pytest.approx(theirs.token_logprobs, abs=1e-4)


def test_echo_without_logprobs_and_streamed(client, llm):
    expected = llm.generate(PROMPT, max_new_tokens=5).text
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, n=2)
    assert [c.text for c in response.choices] == [PROMPT + expected] * 2
    assert response.choices[0].logprobs is None
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True)
    )
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + expected


def test_a_one_token_prompt_echoes_a_null_log_probability(client, llm):
    token = llm.tokenizer.encode("The")[0]
    response = client.completions.create(model=MODEL, prompt=[token], max_tokens=0, echo=True, logprobs=1)
    assert response.choices[0].logprobs.token_logprobs == [None]
    assert response.choices[0].text == llm.tokenizer.decode([token])
