"""Beam search equals Hugging Face's generate(num_beams=..., do_sample=False) token for token on
every tiny architecture, under each early_stopping rule and several length penalties; beams fork
KV rows by copying the parent's prefix, one decode call over all beams per step."""

import pytest
import torch

from hf_oracle import prompts
from kiln.runtime import beam_search
from kiln.runtime.errors import GenerationError
from kiln.runtime.generate import LLM
from search_models import searchable
from test_engine import CallLog
from tiny_models import ARCHITECTURES, EOS_TOKEN_ID, FAMILIES

NEW_TOKENS = 8
OPTION_SETS = [
    dict(num_beams=4),  # Hugging Face's defaults: early_stopping False, length_penalty 1.0
    dict(num_beams=3, early_stopping=True, length_penalty=0.0),
    dict(num_beams=4, early_stopping="never", length_penalty=2.0),
    dict(num_beams=2, early_stopping=False, length_penalty=-1.0),
]


def hf_beams(model, prompt, end_ids, count, **options):
    """Hugging Face's `count` best beams, each cut to its own length."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            num_return_sequences=count,
            return_dict_in_generate=True,
            eos_token_id=sorted(end_ids),
            pad_token_id=0,
            **options,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    return [out.sequences[i, len(prompt) : len(prompt) + lengths[i]].tolist() for i in range(count)]


def ends_a_beam_early(model, prompt, token):
    return any(len(ids) < NEW_TOKENS for ids in hf_beams(model, prompt, {EOS_TOKEN_ID, token}, 2, **OPTION_SETS[0]))


@pytest.mark.parametrize("arch", ARCHITECTURES + [pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_beam_search_equals_hugging_face(tiny_model_dirs, arch):
    llm, model = searchable(tiny_model_dirs(arch))
    (prompt,) = prompts([6], seed=5)
    # A token of the plain search's best beam also ends beams (a stop token id here, a second EOS
    # id there), so hypotheses finish at different lengths and every stopping rule is exercised:
    # the first of its tokens that ends some beam early (BLOOM's tiny model repeats its first ones).
    best = hf_beams(model, prompt, {EOS_TOKEN_ID}, 1, num_beams=4)[0]
    end = next(
        (token for token in dict.fromkeys(best[1:] + best[:1]) if ends_a_beam_early(model, prompt, token)), best[2]
    )
    ended_early = False
    for options in OPTION_SETS:
        count = min(2, options["num_beams"])
        want = hf_beams(model, prompt, {EOS_TOKEN_ID, end}, count, **options)
        got = llm.generate(
            prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[end], num_return_sequences=count, **options
        )
        assert [r.token_ids for r in got] == want, options
        for result in got:
            assert result.finish_reason == ("stop" if result.token_ids[-1] == end else "length")
        ended_early |= any(len(ids) < NEW_TOKENS for ids in want)
    assert ended_early


def test_bans_apply_to_each_beam_as_hugging_face_applies_them(tiny_model_dirs):
    llm, model = searchable(tiny_model_dirs("llama"))
    (prompt,) = prompts([5], seed=8)
    best = hf_beams(model, prompt, {EOS_TOKEN_ID}, 1, num_beams=3)[0]
    end, banned = best[1], [best[2:4], [best[5]]]
    want = hf_beams(model, prompt, {EOS_TOKEN_ID, end}, 1, num_beams=3, min_new_tokens=4, bad_words_ids=banned)[0]
    got = llm.generate(
        prompt, max_new_tokens=NEW_TOKENS, num_beams=3, stop_token_ids=[end], min_tokens=4, bad_words=banned
    )
    assert got.token_ids == want
    assert end not in got.token_ids[:3] and best[5] not in got.token_ids


def test_beams_fork_rows_by_copying_and_share_one_decode_call_per_step(tiny_model_dirs, monkeypatch):
    llm, _ = searchable(tiny_model_dirs("llama"))
    log = CallLog(llm.executable)
    logged = LLM(log, llm.tokenizer, llm.manifest, llm.graph)
    copies, copy_prefix = [], beam_search.copy_prefix
    monkeypatch.setattr(
        beam_search,
        "copy_prefix",
        lambda views, source, target, length: (copies.append(length), copy_prefix(views, source, target, length)),
    )
    (prompt,) = prompts([7], seed=2)
    result = logged.generate(prompt, max_new_tokens=NEW_TOKENS, num_beams=4, ignore_eos=True)
    assert log.calls[0] == (1, len(prompt), 0)  # the prompt, prefilled once
    assert log.calls[1:] == [(4, 1, 0)] * (NEW_TOKENS - 1)  # then one call over the 4 beams' rows per step
    assert copies and copies[0] == len(prompt)  # the first step forks the prompt's row into the others
    assert result.stats.model_steps == len(log.calls)
    assert result.token_ids == llm.generate(prompt, max_new_tokens=NEW_TOKENS, num_beams=4, ignore_eos=True).token_ids


def test_plain_generation_around_a_beam_search_is_unchanged(tiny_model_dirs):
    llm, _ = searchable(tiny_model_dirs("qwen2"))
    batch = prompts([6, 9], seed=3)
    before = [r.token_ids for r in llm.generate(batch, max_new_tokens=6)]
    beams = llm.generate(batch, max_new_tokens=6, num_beams=4)
    assert [r.token_ids for r in llm.generate(batch, max_new_tokens=6)] == before
    assert [r.token_ids for r in beams] == [llm.generate(p, max_new_tokens=6, num_beams=4).token_ids for p in batch]


def test_one_beam_is_greedy_and_logprobs_add_up(tiny_model_dirs):
    llm, _ = searchable(tiny_model_dirs("gpt2"))
    (prompt,) = prompts([6], seed=4)
    greedy = llm.generate(prompt, max_new_tokens=6)
    assert llm.generate(prompt, max_new_tokens=6, num_beams=1).token_ids == greedy.token_ids
    beam = llm.generate(prompt, max_new_tokens=6, num_beams=2, logprobs=2, ignore_eos=True)
    scored = llm.score(prompt, beam.token_ids)
    assert [c.logprob for c in beam.logprobs] == pytest.approx(scored.token_logprobs, abs=1e-4)
    assert all(len(c.top) == 2 for c in beam.logprobs)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_beams=8), "max_batch=4"),
        (dict(num_beams=0), "num_beams must be"),
        (dict(num_beams=2, num_return_sequences=3), "num_return_sequences must be"),
        (dict(num_beams=2, early_stopping="sometimes"), "early_stopping must be"),
        (dict(num_beams=2, length_penalty=float("nan")), "length_penalty must be"),
        (dict(num_beams=2, temperature=0.7), "temperature 0"),
        (dict(num_beams=2, stop=["x"]), "does not take \\['stop'\\]"),
        (dict(num_beams=2, repetition_penalty=1.2), "repetition_penalty"),
        (dict(num_beams=2, penalty_alpha=0.5), "does not combine"),
        (dict(num_beams=2, regex="[a-z]+"), "does not take speculative, json_schema"),
        (dict(num_return_sequences=2), "from 1 to num_beams \\(1\\)"),
        (dict(num_beams=2, n=2), "n and best_of draw samples"),
    ],
)
def test_bad_beam_requests_are_clear_errors(tiny_model_dirs, options, message):
    llm, _ = searchable(tiny_model_dirs("llama"))
    with pytest.raises(GenerationError, match=message):
        llm.generate([5, 6, 7], max_new_tokens=4, **options)
