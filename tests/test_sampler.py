"""The sampler: greedy is argmax, seeded sampling is reproducible, top-k/top-p limit the support."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.errors import GenerationError
from kiln.runtime.sampler import Sampler, SamplingParams, filter_logits


def logits(seed: int = 0, vocab: int = 100) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def draws(params: SamplingParams, seed: int, x: torch.Tensor, n: int = 50) -> list[int]:
    sampler = Sampler(params, seed)
    return [sampler(x) for _ in range(n)]


def test_temperature_zero_is_argmax():
    for seed in range(5):
        x = logits(seed)
        assert Sampler(SamplingParams(temperature=0.0))(x) == int(x.argmax())


def test_same_seed_gives_the_same_tokens():
    params = SamplingParams(temperature=1.0)
    assert draws(params, 3, logits()) == draws(params, 3, logits())


def test_different_seeds_give_different_tokens():
    params = SamplingParams(temperature=5.0)  # flat: draws vary a lot
    assert draws(params, 1, logits()) != draws(params, 2, logits())


def test_top_k_samples_only_the_k_most_likely_tokens():
    x = logits()
    top3 = set(torch.topk(x, 3).indices.tolist())
    assert set(draws(SamplingParams(temperature=10.0, top_k=3), 0, x, n=200)) <= top3


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.isfinite(filter_logits(x, top_p=0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(x, top_p=0.5)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(x, top_p=0.81)).tolist() == [True, True, True, False]
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.7), 0, x, n=200)) == {0, 1}


def test_top_p_always_keeps_the_most_likely_token():
    x = torch.tensor([0.9, 0.1]).log()
    assert torch.isfinite(filter_logits(x, top_p=0.01)).tolist() == [True, False]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_settings_are_refused(kwargs):
    with pytest.raises(GenerationError):
        SamplingParams(**kwargs)
