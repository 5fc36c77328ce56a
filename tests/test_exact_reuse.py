"""Prefix caching never changes a request's results: a prompt reuses only as much of a cached
prefix as leaves every bit of its logits a fresh prefill's (runtime/exact_reuse.py).

The rule is tested on labels directly, then on a tiny Llama compiled by Inductor (exact_width 16)
with an f32 and an int8 KV cache, prefilling 24 tokens a call: each prompt's logprobs after
another prompt filled the cache equal, bit for bit, those of the prompt run in a fresh engine.
"""

from __future__ import annotations

import random

import pytest

from kiln.backends.executable import BackendOptions
from kiln.runtime.exact_reuse import call_labels, exact_reuse, prefill_labels
from kiln.runtime.kv_slots import KvSlots

CHUNK, WIDTH = 24, 16  # a prefill chunk wider than the exact width, as PREFILL_CHUNK (128) is


def test_a_prompt_within_the_exact_width_reuses_any_prefix():
    cached = prefill_labels(0, 10, CHUNK, WIDTH) + call_labels(10, 1, WIDTH)  # a prompt and a reply
    assert set(cached) == {None}
    assert exact_reuse(cached, 11, 16, CHUNK, WIDTH) == 11
    assert exact_reuse(cached, 3, 12, CHUNK, WIDTH) == 3


def test_a_wider_prompt_reuses_only_up_to_a_chunk_boundary_of_the_same_calls():
    # 19 tokens prefilled in one 19-wide call are not the first 19 of a 20-wide call
    assert exact_reuse(prefill_labels(0, 19, CHUNK, WIDTH), 19, 20, CHUNK, WIDTH) == 0
    # a 50-token prompt's first chunk is a 30-token prompt's first chunk; its second is 24 wide
    cached = prefill_labels(0, 30, CHUNK, WIDTH)
    assert exact_reuse(cached, 29, 50, CHUNK, WIDTH) == CHUNK
    # a 30- or 40-token prompt's tokens after it come in one narrow call: one-token bits either way
    assert exact_reuse(cached, 29, 30, CHUNK, WIDTH) == 29
    assert exact_reuse(cached, 29, 40, CHUNK, WIDTH) == 29
    # a 20-token tail after the boundary is one wide call fresh: reuse stops at the boundary
    assert exact_reuse(prefill_labels(0, 44, CHUNK, WIDTH), 43, 44, CHUNK, WIDTH) == CHUNK
    assert exact_reuse(prefill_labels(0, 44, CHUNK, WIDTH), 43, 45, CHUNK, WIDTH) == CHUNK


def test_decoded_tokens_are_reused_only_where_a_fresh_prefill_computes_them_narrowly_too():
    reply = prefill_labels(0, CHUNK, CHUNK, WIDTH) + call_labels(CHUNK, 1, WIDTH) * 10  # prompt, then decoded
    assert exact_reuse(reply, CHUNK + 10, CHUNK + 11, CHUNK, WIDTH) == CHUNK + 10  # a narrow last chunk
    assert exact_reuse(reply, CHUNK + 10, CHUNK + 20, CHUNK, WIDTH) == CHUNK  # a 20-wide one: recomputed
    short = prefill_labels(0, 10, CHUNK, WIDTH) + call_labels(10, 1, WIDTH) * 10
    assert exact_reuse(short, 20, 21, CHUNK, WIDTH) == 0  # fresh, all 21 are one wide call


def test_kv_slots_place_a_prompt_where_its_reuse_is_exact_and_carry_the_labels():
    slots = KvSlots(3, exact_width=WIDTH)
    long, short = list(range(100, 140)), list(range(100, 119))
    slots.occupy(0, "a", [], [])
    slots.fed(0, short, 0)  # one 19-wide call: shares 19 tokens with `long`, none of them exact
    slots.occupy(1, "b", [], [])
    slots.fed(1, long[:CHUNK], 0)
    slots.fed(1, long[CHUNK:30], CHUNK)
    slots.release(0)
    placement = slots.place(long, CHUNK)  # row 1 (busy): a chunk, then 6 narrow: copied
    assert (placement.row, placement.reused, placement.copy_from) == (0, 30, 1)
    assert placement.labels == prefill_labels(0, 30, CHUNK, WIDTH)
    assert slots.place(short + [5], CHUNK).reused == 0
    assert KvSlots(1).exact_width == 1  # no exact width declared: only one-token calls


def test_a_request_waits_for_another_prefill_only_for_what_it_could_reuse_exactly():
    slots, prompt = KvSlots(2, exact_width=WIDTH), list(range(100, 140))
    assert slots.shareable(prompt, prompt, CHUNK) == 39  # a chunk, then a 16-wide (narrow) one
    assert slots.shareable(prompt[:20], prompt[:20], CHUNK) == 0  # one 20-wide call: not a narrow one
    assert slots.shareable(prompt[:20], prompt[:20], 128) == 0
    assert slots.shareable(prompt[:12], prompt[:12], 128) == 11


def engine_results(executable, prompts: list[list[int]]) -> list[tuple[list[int], list[float], int]]:
    """(greedy tokens, their logprobs, cached tokens) of each prompt, run one after another in
    one fresh engine that prefills CHUNK tokens a call."""
    from kiln.runtime.generate import LLM

    llm = LLM(executable)
    llm.engine.prefill_chunk = CHUNK
    results = [llm.generate(p, max_new_tokens=6, logprobs=0) for p in prompts]
    return [(r.token_ids, [t.logprob for t in r.logprobs], r.stats.cached_tokens) for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", ["f32", "int8"])
def test_a_reused_prefix_gives_the_fresh_prefills_logits_on_inductor(tiny_model_dirs, kv_cache):
    from test_batch_invariance import compiled

    executable = compiled(tiny_model_dirs("llama"), BackendOptions(2, 64, kv_cache=kv_cache))
    rng = random.Random(0)
    text = [rng.randrange(3, 500) for _ in range(60)]
    # (prompt, the prompt run before it, tokens it may reuse exactly)
    cases = [
        (text[:20], text[:19], 0),  # all but its last token cached, by a 19-wide call
        (text[:40], text[:40], 39),  # a long shared prefix: a full chunk, then a 16-wide one
        (text[:30], text[:25] + [7], 25),  # a chunk, then narrow calls on both sides
        (text[:40], text[:20] + [7], 0),  # a 21-wide call is not a fresh prefill's chunk
        (text[:12], text[:3] + [7], 3),  # within the exact width: anything
    ]
    for prompt, before, reusable in cases:
        alone = engine_results(executable, [prompt])[0]
        after = engine_results(executable, [before, prompt])[1]
        assert after[2] == reusable, (len(prompt), len(before))
        assert after[:2] == alone[:2], (len(prompt), len(before))
    # a chat history: the prompt, its reply (decoded one token a call) and the next turn's start
    first = engine_results(executable, [text[:CHUNK]])[0][0]
    history = text[:CHUNK] + first[:5]
    alone = engine_results(executable, [history])[0]
    after = engine_results(executable, [text[:CHUNK], history])[1]
    assert after[2] == len(history) - 1 and after[:2] == alone[:2]
