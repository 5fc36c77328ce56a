"""Each sampling option changes the distribution the way it should, checked on known distributions.

Frequencies come from a few thousand seeded draws; tolerances are several standard errors wide.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kiln.runtime import logits_processors as lp
from kiln.runtime.sampler import Sampler, SamplingParams

DRAWS = 4000


def frequencies(params: SamplingParams, logits: torch.Tensor, prompt=(), generated=(), seed=0) -> dict[int, float]:
    sampler = Sampler(params, seed)
    counts = Counter(sampler(logits, prompt, generated) for _ in range(DRAWS))
    return {t: c / DRAWS for t, c in counts.items()}


def assert_distribution(freq: dict[int, float], expected: dict[int, float]):
    assert set(freq) == {t for t, p in expected.items() if p > 0}
    for token, p in expected.items():
        tolerance = 4 * math.sqrt(p * (1 - p) / DRAWS) + 1e-9
        assert abs(freq.get(token, 0.0) - p) <= tolerance, (token, freq, expected)


def renormalized(probs: list[float], keep: set[int]) -> dict[int, float]:
    mass = sum(probs[t] for t in keep)
    return {t: (probs[t] / mass if t in keep else 0.0) for t in range(len(probs))}


PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor(PROBS).log()


def test_plain_sampling_follows_the_softmax():
    assert_distribution(frequencies(SamplingParams(temperature=1.0), LOGITS), dict(enumerate(PROBS)))


def test_temperature_sharpens_and_flattens():
    for temperature in (0.5, 2.0):
        scaled = torch.softmax(LOGITS / temperature, dim=-1).tolist()
        assert_distribution(frequencies(SamplingParams(temperature=temperature), LOGITS), dict(enumerate(scaled)))


def test_min_p_drops_tokens_below_a_fraction_of_the_top_one():
    # 0.2 * 0.5 = 0.1: token 3 (0.05) goes, the rest keep their relative odds
    assert_distribution(frequencies(SamplingParams(temperature=1.0, min_p=0.2), LOGITS), renormalized(PROBS, {0, 1, 2}))


def test_typical_keeps_tokens_whose_surprisal_is_near_the_entropy():
    probs = [0.4, 0.3, 0.2, 0.1]
    # entropy 1.28 nats; |surprisal - entropy| = 0.36, 0.08, 0.33, 1.02: token 1, then 2, reach mass 0.5
    # before the most likely token does, so typical sampling drops the argmax here
    freq = frequencies(SamplingParams(temperature=1.0, typical_p=0.5), torch.tensor(probs).log())
    assert_distribution(freq, renormalized(probs, {1, 2}))


def test_eta_cutoff_is_tighter_for_peaked_distributions():
    peaked = [0.6, 0.25, 0.1, 0.05]  # entropy 1.03: cutoff min(0.09, 0.3 * e^-1.03 = 0.107) = 0.09
    freq = frequencies(SamplingParams(temperature=1.0, eta=0.09), torch.tensor(peaked).log())
    assert_distribution(freq, renormalized(peaked, {0, 1, 2}))
    flat = torch.zeros(4)  # entropy ln 4: cutoff 0.3 * 0.25 = 0.075 < 0.25 keeps everything
    assert torch.isfinite(lp.eta(flat, 0.09)).all()


def test_top_k_and_top_p_limit_the_support():
    assert_distribution(frequencies(SamplingParams(temperature=1.0, top_k=2), LOGITS), renormalized(PROBS, {0, 1}))
    assert_distribution(frequencies(SamplingParams(temperature=1.0, top_p=0.7), LOGITS), renormalized(PROBS, {0, 1}))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([2.0, 2.0, -1.0, -1.0])
    penalized = lp.repetition_penalty(logits, [0, 2, 0], 2.0)
    assert penalized.tolist() == [1.0, 2.0, -2.0, -1.0]
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    expected = torch.softmax(penalized, dim=-1).tolist()
    assert_distribution(frequencies(params, logits, prompt=[0], generated=[2]), dict(enumerate(expected)))
    assert Sampler(SamplingParams(repetition_penalty=2.0))(logits, prompt=[0]) == 1  # greedy moves off token 0


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(4)
    penalized = lp.presence_frequency_penalty(logits, [0, 0, 1], presence=0.5, frequency=0.25)
    assert penalized.tolist() == [-1.0, -0.75, 0.0, 0.0]
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    expected = torch.softmax(penalized, dim=-1).tolist()
    assert_distribution(frequencies(params, logits, prompt=[2, 2, 3], generated=[0, 0, 1]), dict(enumerate(expected)))


def test_logit_bias_bans_and_forces_tokens():
    banned = frequencies(SamplingParams(temperature=1.0, logit_bias={0: -100.0}), LOGITS)
    assert_distribution(banned, renormalized(PROBS, {1, 2, 3}))
    assert Sampler(SamplingParams(logit_bias={3: 100.0}))(LOGITS) == 3


def test_logprobs_come_from_the_models_distribution_with_top_alternatives():
    choice = Sampler(SamplingParams(temperature=1.0, top_k=1, logprobs=2), seed=1).choose(LOGITS)
    assert choice.token == 0
    assert choice.logprob == pytest.approx(math.log(0.5), abs=1e-6)  # the model's, not the top-k-truncated 0
    assert [t for t, _ in choice.top] == [0, 1]
    assert [p for _, p in choice.top] == pytest.approx([math.log(0.5), math.log(0.3)], abs=1e-6)


def test_the_same_seed_and_context_reproduce_the_same_tokens():
    params = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.3)
    runs = [[Sampler(params, 7)(LOGITS, [1], []) for _ in range(50)] for _ in range(2)]
    assert runs[0] == runs[1]
