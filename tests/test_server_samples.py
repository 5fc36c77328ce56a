"""`n` and `best_of` in the server, driven by the `openai` client: choice j is the request run
alone with seed + j, the samples share one prefill of the prompt, best_of answers the likeliest,
and a stream tags each chunk with its choice's index."""

from __future__ import annotations

import openai
import pytest

import kiln
from kiln.runtime.samples import cumulative_logprob
from kiln.runtime.server import create_app
from served import record_submits, served, tiny_llama_artifact

MODEL = "tiny-llama"
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"  # 16+ tokens
SAMPLED = dict(temperature=0.9, max_tokens=8, seed=11)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs, tmp_path_factory):
    return kiln.load(tiny_llama_artifact(tiny_model_dirs, tmp_path_factory))


@pytest.fixture(scope="module")
def client(llm):
    with served(create_app(llm, MODEL)) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def alone(llm, prompt, seed, **kwargs):
    return llm.generate(
        prompt, max_new_tokens=SAMPLED["max_tokens"], temperature=SAMPLED["temperature"], seed=seed, **kwargs
    )


@pytest.fixture
def submitted(llm, monkeypatch):
    """The handles of every request the server submits from now on."""
    return record_submits(llm, monkeypatch)


def test_n_completions_are_the_request_with_successive_seeds_sharing_one_prefill(client, llm, submitted, monkeypatch):
    # the prompt's 27 tokens in chunks of 13: the 26 before the last end at a chunk boundary, which
    # the reference backend (no exact_width) needs for a reused prefix to be exact (exact_reuse.py)
    monkeypatch.setattr(llm.engine, "prefill_chunk", 13)
    response = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    expected = [alone(llm, PROMPT, SAMPLED["seed"] + j) for j in range(3)]
    assert [choice.text for choice in response.choices] == [result.text for result in expected]
    results = [handle.result() for handle in submitted]
    prompt_tokens = len(results[0].prompt_token_ids)
    # sample 0 prefills the prompt; the others copy its keys and values (all but the last token,
    # which each feeds for its own first token)
    assert [r.stats.cached_tokens for r in results] == [0] + [prompt_tokens - 1] * 2
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == sum(len(r.token_ids) for r in expected)


def test_n_chat_choices(client, llm):
    messages = [{"role": "user", "content": "Tell me about Paris and Rome, please."}]
    response = client.chat.completions.create(model=MODEL, messages=messages, n=3, **SAMPLED)
    expected = [llm.chat(messages, max_new_tokens=8, temperature=0.9, seed=11 + j).text for j in range(3)]
    assert [(c.index, c.message.content) for c in response.choices] == list(enumerate(expected))


def test_best_of_answers_the_likeliest_samples(client, llm):
    response = client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, logprobs=1, **SAMPLED)
    drawn = [alone(llm, PROMPT, SAMPLED["seed"] + j, logprobs=1) for j in range(4)]
    likeliest = sorted(drawn, key=cumulative_logprob, reverse=True)[:2]
    assert [choice.text for choice in response.choices] == [result.text for result in likeliest]
    for choice, result in zip(response.choices, likeliest):  # f32 rounding: the reference backend's
        # decode over several rows is not bit for bit its decode over one
        assert choice.logprobs.token_logprobs == pytest.approx([entry.logprob for entry in result.logprobs], abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, n=1, best_of=3, **SAMPLED)
    assert plain.choices[0].logprobs is None and len(plain.choices) == 1


def test_streamed_samples_carry_their_choice_index(client, llm):
    texts, reasons = {}, {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, n=3, stream=True, **SAMPLED):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    assert texts == {j: alone(llm, PROMPT, SAMPLED["seed"] + j).text for j in range(3)}
    assert set(reasons) == {0, 1, 2}
    messages = [{"role": "user", "content": "Hi there"}]
    contents = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=2, stream=True, **SAMPLED):
        for choice in chunk.choices:
            contents[choice.index] = contents.get(choice.index, "") + (choice.delta.content or "")
    assert contents == {j: llm.chat(messages, max_new_tokens=8, temperature=0.9, seed=11 + j).text for j in range(2)}


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(n=0), "n"),
        (dict(n=65), "n"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(n=1, best_of=2, stream=True), "best_of"),
    ],
)
def test_bad_counts_are_400_naming_the_field(client, bad, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **bad)
    assert caught.value.body["param"] == param
