"""Scoring given text (`llm.score`): each continuation token's log-probability equals Hugging
Face's log-softmax of the same logits within 1e-4 (fp32), across prefill chunks too."""

import pytest
import torch

import kiln
from hf_oracle import prompts
from kiln.frontend.checkpoint import load_model
from kiln.runtime import scoring
from kiln.runtime.errors import ContextLengthError, GenerationError, TokenIdError

MAX_SEQ = 64


@pytest.fixture(scope="module")
def llama(tiny_model_dirs, tmp_path_factory):
    source = tiny_model_dirs("llama")
    path = kiln.compile(
        str(source),
        out=tmp_path_factory.mktemp("score") / "m.kiln",
        backend="reference",
        max_seq_len=MAX_SEQ,
        max_batch=2,
    )
    return kiln.load(path), load_model(source).model


def hf_logprobs(model, prompt, continuation):
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    return [log_probs[len(prompt) - 1 + i, token].item() for i, token in enumerate(continuation)], log_probs


@pytest.mark.parametrize("chunk", [scoring.SCORE_CHUNK, 5])
def test_scores_equal_hugging_face_log_probabilities(llama, monkeypatch, chunk):
    llm, model = llama
    monkeypatch.setattr(scoring, "SCORE_CHUNK", chunk)  # 5: the text crosses several model calls
    prompt, continuation = prompts([7, 12], seed=3)
    scores = llm.score(prompt, continuation, top_n=3)
    want, log_probs = hf_logprobs(model, prompt, continuation)
    assert scores.token_ids == continuation
    assert scores.token_logprobs == pytest.approx(want, abs=1e-4)
    assert scores.total == pytest.approx(sum(want), abs=1e-3)
    best = log_probs[len(prompt) - 1].topk(3)
    assert list(scores.top_logprobs[0]) == best.indices.tolist()
    assert list(scores.top_logprobs[0].values()) == pytest.approx(best.values.tolist(), abs=1e-4)


def test_scoring_between_generations_leaves_them_unchanged(llama):
    llm, _ = llama
    prompt, continuation = prompts([6, 4], seed=4)
    before = llm.generate(prompt, max_new_tokens=6).token_ids
    first = llm.score(prompt, continuation).token_logprobs
    assert llm.generate(prompt, max_new_tokens=6).token_ids == before
    assert llm.score(prompt, continuation).token_logprobs == first


def test_bad_scoring_input_is_a_clear_error(llama):
    llm, _ = llama
    with pytest.raises(GenerationError, match="at least one token to score"):
        llm.score([5, 6], [])
    with pytest.raises(GenerationError, match="at least one prompt token"):
        llm.score([], [5])
    with pytest.raises(ContextLengthError):
        llm.score([5] * 40, [6] * 40)
    with pytest.raises(TokenIdError):
        llm.score([5], [10**9])
