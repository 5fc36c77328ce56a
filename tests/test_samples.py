"""`n` and `best_of` in `generate`: sample j of a prompt equals that prompt generated alone with
seed + j, the prompt is prefilled once for all samples, and best_of keeps the likeliest."""

import pytest

from kiln.runtime.errors import GenerationError
from kiln.runtime.generate import LLM
from kiln.runtime.samples import cumulative_logprob
from test_engine import CallLog, alone, executable
from test_generate_loop import tiny_stateful_graph  # noqa: F401 - test_engine's executable needs it

PROMPT = list(range(10, 27))  # 17 tokens: two chunks of 8, then the last token (fed by a decode call)
SAMPLED = dict(max_new_tokens=5, temperature=1.0)


def test_n_samples_are_the_prompt_with_successive_seeds_and_share_one_prefill():
    log = CallLog(executable())
    llm = LLM(log)
    llm.engine.prefill_chunk = 8
    samples = llm.generate(PROMPT, n=3, seed=7, **SAMPLED)
    expected = [alone(PROMPT, prefill_chunk=8, seed=7 + j, **SAMPLED).token_ids for j in range(3)]
    assert [s.token_ids for s in samples] == expected
    # the two chunks once (all the reference backend can reuse exactly: runtime/exact_reuse.py)
    assert sum(seq for batch, seq, row in log.calls if seq > 1) == 16


def test_a_list_of_prompts_gives_n_results_per_prompt():
    prompts = [PROMPT, [5, 6, 7]]
    per_prompt = LLM(executable()).generate(prompts, n=2, seed=[1, 100], **SAMPLED)
    assert [[s.token_ids for s in samples] for samples in per_prompt] == [
        [alone(p, seed=s + j, **SAMPLED).token_ids for j in range(2)] for p, s in zip(prompts, (1, 100))
    ]


def test_best_of_keeps_the_n_samples_with_the_highest_cumulative_log_probability():
    drawn = [alone(PROMPT, seed=3 + j, logprobs=0, **SAMPLED) for j in range(4)]
    likeliest = sorted(drawn, key=cumulative_logprob, reverse=True)[:2]
    kept = LLM(executable()).generate(PROMPT, n=2, best_of=4, seed=3, **SAMPLED)
    assert [s.token_ids for s in kept] == [s.token_ids for s in likeliest]
    assert all(s.logprobs is None for s in kept)  # computed for the ranking, not asked for


@pytest.mark.parametrize("n, best_of", [(0, None), (1.5, None), (True, None), (3, 2), (2, 1000)])
def test_bad_sample_counts_are_clear_errors(n, best_of):
    with pytest.raises(GenerationError, match="n must be|best_of must be"):
        LLM(executable()).generate(PROMPT, n=n, best_of=best_of)
