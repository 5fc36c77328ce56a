"""`kiln serve --reward-model`: completions' best_of answers the samples a reward model scores
highest (checked against Hugging Face's reward model), driven by the `openai` client; a reward
model is refused as the served model, and a causal LM as the reward model."""

from __future__ import annotations

import openai
import pytest
import torch

import kiln
from kiln import cli
from kiln.runtime.errors import GenerationError
from kiln.runtime.samples import cumulative_logprob
from kiln.runtime.server import create_app
from served import served, tiny_llama_artifact
from tiny_models import save_tiny_reward_model

MODEL = "tiny-llama"
PROMPT = "The capital of France is"
SAMPLED = dict(temperature=1.0, max_tokens=6, seed=11)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs, tmp_path_factory):
    return kiln.load(tiny_llama_artifact(tiny_model_dirs, tmp_path_factory))


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    """(the reward artifact's path, the Hugging Face reward model, its tokenizer)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("served-reward")
    source = save_tiny_reward_model("llama", root / "checkpoint")
    path = kiln.compile(str(source), out=root / "rm.kiln", backend="reference", max_seq_len=128)
    model = AutoModelForSequenceClassification.from_pretrained(source, dtype=torch.float32).eval()
    return path, model, AutoTokenizer.from_pretrained(source)


@pytest.fixture(scope="module")
def client(llm, reward):
    with served(create_app(llm, MODEL, reward_model=kiln.load(reward[0]))) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_best_of_answers_the_samples_the_reward_model_scores_highest(client, llm, reward):
    _, model, tokenizer = reward
    drawn = [
        llm.generate(
            PROMPT, max_new_tokens=SAMPLED["max_tokens"], temperature=1.0, seed=SAMPLED["seed"] + j, logprobs=0
        )
        for j in range(5)
    ]
    with torch.no_grad():
        scores = [model(**tokenizer(PROMPT + r.text, return_tensors="pt")).logits.item() for r in drawn]
    best = [drawn[i].text for i in sorted(range(5), key=scores.__getitem__, reverse=True)[:2]]
    response = client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=5, **SAMPLED)
    assert [choice.text for choice in response.choices] == best
    assert all(choice.logprobs is None for choice in response.choices)
    assert response.usage.completion_tokens == sum(len(r.token_ids) for r in drawn)
    likeliest = sorted(drawn, key=cumulative_logprob, reverse=True)[:2]
    assert [r.text for r in likeliest] != best  # the reward, not the log-probability, ranked them


def test_a_reward_model_is_not_served_and_a_causal_lm_does_not_rank(llm, reward, tiny_model_dirs, tmp_path_factory):
    reward_llm = kiln.load(reward[0])
    with pytest.raises(GenerationError, match="is a reward model.*Fix: serve a causal LM"):
        create_app(reward_llm, MODEL)
    with pytest.raises(GenerationError, match="--reward-model artifact is not a reward model"):
        create_app(llm, MODEL, reward_model=llm)


def test_kiln_serve_refuses_a_reward_model_in_one_line(reward, capsys):
    assert cli.kiln_main(["serve", str(reward[0])]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: The artifact to serve is a reward model") and err.count("\n") == 1
