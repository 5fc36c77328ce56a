"""min_tokens and bad_words: the tokens they ban equal Hugging Face's MinNewTokensLength and
NoBadWords processors', sampling draws from the distribution without them, and generation with
them equals Hugging Face's generate(min_new_tokens=..., bad_words_ids=...)."""

import math

import pytest
import torch
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor

from hf_oracle import prompts
from kiln.runtime.bad_words import word_spellings
from kiln.runtime.errors import GenerationError, TokenIdError, TokenizerError
from kiln.runtime.generate import LLM
from kiln.runtime.sampler import Sampler, SamplingParams
from search_models import searchable
from test_engine import executable
from test_generate_loop import tiny_stateful_graph  # noqa: F401 - test_engine's executable needs it
from test_sampling_suite import assert_distribution, renormalized
from tiny_models import EOS_TOKEN_ID

VOCAB = 12


def assert_same_bans(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor):
    banned = torch.isinf(want)
    assert torch.equal(torch.isinf(got), banned)
    assert torch.equal(got[~banned], logits[~banned])


def test_bad_word_bans_equal_hugging_faces_processor():
    sequences = [[7], [3, 4], [1, 3, 5], [5, 5, 6], [9, 2], [8, 8, 8, 10]]
    sampler = Sampler(SamplingParams(bad_words=sequences))
    processor = NoBadWordsLogitsProcessor(sequences)
    generator = torch.Generator().manual_seed(0)
    for context in ([3], [1, 3], [5, 5], [9], [2, 5, 5], [0], [8, 8, 8], [8, 1, 3], [6, 8, 8]):
        for split in range(len(context) + 1):  # the prompt ends at `split`: a sequence may span both
            logits = torch.randn(VOCAB, generator=generator)
            want = processor(torch.tensor([context]), logits[None].clone())[0]
            assert_same_bans(sampler.ban(logits, context[:split], context[split:]), want, logits)


def test_min_tokens_bans_every_end_token_as_hugging_face_does():
    prompt, ends = [5, 6, 7], [0, 3]
    sampler = Sampler(SamplingParams(min_tokens=3), end_ids=frozenset(ends))
    processor = MinNewTokensLengthLogitsProcessor(len(prompt), 3, ends)
    generator = torch.Generator().manual_seed(1)
    for generated in ([], [1], [1, 2], [1, 2, 4], [1, 2, 4, 5]):
        logits = torch.randn(VOCAB, generator=generator)
        want = processor(torch.tensor([prompt + generated]), logits[None].clone())[0]
        assert_same_bans(sampler.ban(logits, prompt, generated), want, logits)


PROBS = [0.4, 0.3, 0.2, 0.1]


def frequencies(sampler: Sampler, generated, prompt=(8,), draws: int = 4000) -> dict[int, float]:
    logits = torch.tensor(PROBS).log()
    counts: dict[int, int] = {}
    for _ in range(draws):
        token = sampler(logits, prompt, generated)
        counts[token] = counts.get(token, 0) + 1
    return {t: c / draws for t, c in counts.items()}


def test_sampling_draws_from_what_the_bans_leave():
    min_tokens = Sampler(SamplingParams(temperature=1.0, min_tokens=2), seed=3, end_ids=frozenset({0}))
    assert_distribution(frequencies(min_tokens, [1]), renormalized(PROBS, {1, 2, 3}))  # one new token: EOS waits
    assert_distribution(frequencies(min_tokens, [1, 2]), dict(enumerate(PROBS)))  # two: free again
    bad_words = Sampler(SamplingParams(temperature=1.0, bad_words=[[2, 1], [9, 2, 3]]), seed=4)
    assert_distribution(frequencies(bad_words, [2]), renormalized(PROBS, {0, 2, 3}))  # [2, 1] would complete
    assert_distribution(frequencies(bad_words, [5]), dict(enumerate(PROBS)))
    # after prompt [9] and output [2] both sequences would complete, one across the boundary
    assert_distribution(frequencies(bad_words, [2], prompt=(9,)), renormalized(PROBS, {0, 2}))


def hf_greedy_with(model, prompt, new_tokens, **options):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **options,
        )[0, len(prompt) :].tolist()


def test_generation_with_bans_equals_hugging_face(tiny_model_dirs):
    llm, model = searchable(tiny_model_dirs("llama"))
    (prompt,) = prompts([6], seed=11)
    plain = llm.generate(prompt, max_new_tokens=10).token_ids
    banned = [plain[1:3], [plain[4]]]
    got = llm.generate(prompt, max_new_tokens=10, bad_words=banned).token_ids
    assert got == hf_greedy_with(model, prompt, 10, bad_words_ids=banned, eos_token_id=EOS_TOKEN_ID)
    assert got != plain and plain[4] not in got
    stop = plain[1]  # ends the plain output after two tokens; min_tokens holds it off
    assert llm.generate(prompt, max_new_tokens=10, stop_token_ids=[stop]).token_ids == plain[:2]
    held = llm.generate(prompt, max_new_tokens=10, stop_token_ids=[stop], min_tokens=5)
    assert held.token_ids == hf_greedy_with(model, prompt, 10, min_new_tokens=5, eos_token_id=[EOS_TOKEN_ID, stop])
    assert stop not in held.token_ids[:5]


def test_words_are_banned_as_the_tokenizer_spells_them(tiny_model_dirs):
    llm, _ = searchable(tiny_model_dirs("llama"))
    (prompt,) = prompts([6], seed=12)
    plain = llm.generate(prompt, max_new_tokens=8)
    word = llm.tokenizer.decode([plain.token_ids[2]]).strip() or "the"
    spellings = word_spellings(llm.tokenizer, word)
    assert spellings[0] == llm.tokenizer.encode(word, add_special_tokens=False)
    assert llm.tokenizer.encode(" " + word, add_special_tokens=False) in spellings
    by_word = llm.generate(prompt, max_new_tokens=8, bad_words=[word])
    assert by_word.token_ids == llm.generate(prompt, max_new_tokens=8, bad_words=spellings).token_ids
    for spelling in spellings:
        assert all(by_word.token_ids[i : i + len(spelling)] != spelling for i in range(len(by_word.token_ids)))


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(min_tokens=-1), GenerationError, "min_tokens must be"),
        (dict(min_tokens=1.5), GenerationError, "min_tokens must be"),
        (dict(bad_words=[[]]), GenerationError, "non-empty list of token ids"),
        (dict(bad_words=[[5, -1]]), GenerationError, "non-empty list of token ids"),
        (dict(bad_words="abc"), GenerationError, "bad_words must be a list"),
        (dict(bad_words=[[5, 10**6]]), TokenIdError, "bad_words"),
        (dict(bad_words=["word"]), TokenizerError, "need the artifact's tokenizer"),
    ],
)
def test_bad_ban_settings_are_clear_errors(options, error, message):
    llm = LLM(executable())  # no tokenizer
    with pytest.raises(error, match=message):
        llm.generate([5, 6, 7], max_new_tokens=3, **options)


def test_bans_leave_greedy_decoding_alone_when_nothing_matches():
    llm = LLM(executable())
    plain = llm.generate([5, 6, 7], max_new_tokens=6).token_ids
    assert (
        llm.generate([5, 6, 7], max_new_tokens=6, bad_words=[[plain[0] + 1, 99], [1, 2, 3, 4]], min_tokens=2).token_ids
        == plain
    )
    assert not math.isinf(float(Sampler(SamplingParams(min_tokens=9)).ban(torch.zeros(4), [], []).min()))
