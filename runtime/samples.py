"""`n` and `best_of`: several samples of each prompt from one `generate` call.

    llm.generate(prompt, n=3, temperature=0.8)                # -> [result, result, result]
    llm.generate(prompts, n=2, best_of=5, temperature=0.8)    # -> per prompt, the 2 likeliest of 5

Sample j of a prompt whose seed is s is generated with seed s + j (sample 0 is what the same
call without `n` gives). The samples run through the engine side by side; the first prefills the
prompt and the others copy its keys and values (`Engine._prefill_to_share`), so the prompt is
prefilled once. `best_of` draws that many and keeps the `n` with the highest cumulative
log-probability of their tokens (log-probabilities are computed for the ranking even when the
caller asked for none, and then left out of the results).

    llm.generate(prompt, n=2, best_of=8, temperature=0.8, reward_model=rm)  # the 2 best by rm

With `reward_model` (a reward artifact from kiln.load: runtime/rewards.py) the samples are ranked
by its reward of the prompt's text followed by the sample's text, highest first, instead. A prompt
given as token ids is decoded with its special tokens (a chat prompt keeps its template's
markers); the reward model tokenizes the joined text with its own tokenizer.
"""

from __future__ import annotations

import dataclasses
import numbers

from kiln.runtime.errors import GenerationError
from kiln.runtime.results import GenerationResult

MAX_SAMPLES = 64  # samples per prompt: each takes a KV row (or waits for one)


def check_counts(n, best_of) -> tuple[int, int]:
    """(n, best_of) as ints, best_of defaulting to n; GenerationError when out of range."""
    if not _is_count(n):
        raise GenerationError(f"n must be an integer from 1 to {MAX_SAMPLES}, got {n!r:.40}. Fix: pass e.g. n=2.")
    best_of = n if best_of is None else best_of
    if not _is_count(best_of) or best_of < n:
        raise GenerationError(
            f"best_of must be an integer from n ({n}) to {MAX_SAMPLES}, got {best_of!r:.40}. "
            "Fix: pass best_of >= n, or leave it out."
        )
    return int(n), int(best_of)


def generate_samples(llm, prompts, n: int, best_of: int | None, seed, keywords: dict, reward_model=None):
    """`llm.generate` with `n` / `best_of` (see the module docstring); `keywords` are generate's
    other arguments. One prompt -> a list of n results; a list -> a list of such lists."""
    n, best_of = check_counts(n, best_of)
    if reward_model is not None and getattr(reward_model, "task", None) != "reward":
        raise GenerationError(
            f"reward_model must be a reward model loaded with kiln.load, got {reward_model!r:.60}. "
            "Fix: compile a *ForSequenceClassification checkpoint (one label) and pass its LLM."
        )
    searched = sorted(set(keywords) & {"num_beams", "penalty_alpha"})
    if searched:
        raise GenerationError(
            f"n and best_of draw samples; {searched} search deterministically. Fix: drop n and "
            "best_of (num_return_sequences returns several beams)."
        )
    single, token_lists = llm._encode_prompts(prompts)
    seeds = _sample_seeds(seed, len(token_lists), best_of)
    ranking = best_of > n or reward_model is not None
    added_logprobs = ranking and reward_model is None and keywords.get("logprobs") is None
    if added_logprobs:
        keywords = {**keywords, "logprobs": 0}
    flat = llm.generate([ids for ids in token_lists for _ in range(best_of)], seed=seeds, **keywords)
    per_prompt = [flat[i * best_of : (i + 1) * best_of] for i in range(len(token_lists))]
    if reward_model is not None:
        texts = prompt_texts(llm, [prompts] if single else list(prompts), token_lists)
        per_prompt = [by_reward(reward_model, text, samples)[:n] for text, samples in zip(texts, per_prompt)]
    elif ranking:
        per_prompt = [sorted(samples, key=cumulative_logprob, reverse=True)[:n] for samples in per_prompt]
    if added_logprobs:
        per_prompt = [[dataclasses.replace(r, logprobs=None) for r in samples] for samples in per_prompt]
    return per_prompt[0] if single else per_prompt


def cumulative_logprob(result: GenerationResult) -> float:
    return sum(choice.logprob for choice in result.logprobs or ())


def by_reward(reward_model, prompt_text: str, samples: list[GenerationResult]) -> list[GenerationResult]:
    """The samples, highest reward of prompt + sample text first (ties keep their order)."""
    rewards = reward_model.reward([prompt_text + sample.text for sample in samples])
    order = sorted(range(len(samples)), key=lambda i: rewards[i], reverse=True)
    return [samples[i] for i in order]


def prompt_texts(llm, given: list, token_lists: list[list[int]]) -> list[str]:
    """Each prompt's text: as given, or its token ids decoded with their special tokens."""
    if any(not isinstance(prompt, str) for prompt in given):
        llm._require_tokenizer()
    return [
        prompt if isinstance(prompt, str) else llm.tokenizer.decode(ids, skip_special_tokens=False)
        for prompt, ids in zip(given, token_lists)
    ]


def _sample_seeds(seed, prompts: int, samples: int) -> list[int]:
    from kiln.runtime.generate import SEED_LIMIT, _seeds

    return [(base + j) % SEED_LIMIT for base in _seeds(seed, prompts) for j in range(samples)]


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 1 <= value <= MAX_SAMPLES
