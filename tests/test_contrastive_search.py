"""Contrastive search equals a plain implementation of Su et al.'s rule (2022) over the Hugging
Face model's own hidden states, on every tiny architecture (transformers no longer ships the
method itself); its candidates run in one decode call per token."""

import pytest
import torch

from hf_oracle import prompts
from kiln.runtime import row_prefill
from kiln.runtime.errors import GenerationError
from kiln.runtime.generate import LLM
from search_models import searchable
from test_engine import CallLog, executable
from test_generate_loop import tiny_stateful_graph  # noqa: F401 - test_engine's executable needs it
from tiny_models import ARCHITECTURES, FAMILIES

NEW_TOKENS = 8


def reference_contrastive(model, prompt, alpha, k, new_tokens):
    """Each step, by full forwards without a cache: the top-k tokens v by probability, each scored
    (1 - alpha) p(v) - alpha max_j cos(h(v), h_j) over the context's last hidden states h_j."""
    ids = list(prompt)
    for _ in range(new_tokens):
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
            context = out.hidden_states[-1][0]
            top = torch.topk(torch.softmax(out.logits[0, -1].float(), dim=-1), k)
            candidates = torch.tensor([ids + [token] for token in top.indices.tolist()])
            hidden = model(candidates, output_hidden_states=True).hidden_states[-1][:, -1]
        scores = []
        for probability, state in zip(top.values.tolist(), hidden):
            similarity = max(torch.nn.functional.cosine_similarity(state, past, dim=0).item() for past in context)
            scores.append((1 - alpha) * probability - alpha * similarity)
        ids.append(top.indices[max(range(k), key=scores.__getitem__)].item())
    return ids[len(prompt) :]


@pytest.mark.parametrize("arch", ARCHITECTURES + [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_contrastive_search_equals_the_papers_rule(tiny_model_dirs, arch):
    llm, model = searchable(tiny_model_dirs(arch))
    (prompt,) = prompts([7], seed=6)
    greedy = llm.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
    differs = False
    for alpha, k in ((0.6, 4), (0.3, 3)):
        got = llm.generate(prompt, max_new_tokens=NEW_TOKENS, penalty_alpha=alpha, top_k=k, ignore_eos=True)
        assert got.token_ids == reference_contrastive(model, prompt, alpha, k, NEW_TOKENS), (alpha, k)
        differs |= got.token_ids != greedy
    assert differs  # the penalty changed something
    assert (
        llm.generate(prompt, max_new_tokens=NEW_TOKENS, penalty_alpha=0.0, top_k=4, ignore_eos=True).token_ids == greedy
    )


def test_candidates_run_in_one_call_per_token(tiny_model_dirs):
    llm, _ = searchable(tiny_model_dirs("llama"))
    log = CallLog(llm.executable)
    logged = LLM(log, llm.tokenizer, llm.manifest, llm.graph)
    (prompt,) = prompts([5], seed=7)
    result = logged.generate(prompt, max_new_tokens=6, penalty_alpha=0.5, top_k=3, ignore_eos=True, logprobs=1)
    assert log.calls == [(1, len(prompt), 0)] + [(3, 1, 0)] * 6
    assert result.stats.model_steps == len(log.calls)
    assert [c.logprob for c in result.logprobs] == pytest.approx(
        llm.score(prompt, result.token_ids).token_logprobs, abs=1e-4
    )


def test_a_prompt_prefilled_in_chunks_gives_the_same_tokens(tiny_model_dirs, monkeypatch):
    llm, _ = searchable(tiny_model_dirs("mistral"))
    (prompt,) = prompts([11], seed=9)
    options = dict(max_new_tokens=5, ignore_eos=True)
    whole = [
        llm.generate(prompt, penalty_alpha=0.5, top_k=3, **options).token_ids,
        llm.generate(prompt, num_beams=3, **options).token_ids,
    ]
    monkeypatch.setattr(row_prefill, "CHUNK", 4)  # the prompt's hidden states come from three calls
    assert [
        llm.generate(prompt, penalty_alpha=0.5, top_k=3, **options).token_ids,
        llm.generate(prompt, num_beams=3, **options).token_ids,
    ] == whole


def test_every_chosen_token_is_fed_so_the_context_holds_one_fewer(tiny_model_dirs):
    llm, _ = searchable(tiny_model_dirs("qwen2"))
    prompt = prompts([llm.max_seq_len - 3], seed=8)[0]
    result = llm.generate(prompt, max_new_tokens=10, penalty_alpha=0.5, top_k=2, ignore_eos=True)
    assert len(result.token_ids) == 3 and result.finish_reason == "context"


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(penalty_alpha=0.5, top_k=8), "max_batch=4"),
        (dict(penalty_alpha=0.5), "needs top_k"),
        (dict(penalty_alpha=1.5, top_k=2), "penalty_alpha must be"),
        (dict(penalty_alpha=0.5, top_k=2, temperature=0.8), "temperature 0"),
        (dict(penalty_alpha=0.5, top_k=2, speculative="prompt_lookup"), "does not take speculative"),
    ],
)
def test_bad_contrastive_requests_are_clear_errors(tiny_model_dirs, options, message):
    llm, _ = searchable(tiny_model_dirs("llama"))
    with pytest.raises(GenerationError, match=message):
        llm.generate([5, 6, 7], max_new_tokens=4, **options)


def test_without_a_graph_contrastive_search_says_how_to_get_one():
    with pytest.raises(GenerationError, match="kiln.load"):
        LLM(executable()).generate([5, 6, 7], max_new_tokens=3, penalty_alpha=0.5, top_k=2)
