"""The continuous-batching engine: slots, chunked prefill, prefix caching, cancellation, queue
bound, async iteration; every request's output equal to the same request run alone.

Most tests use the hand-built one-layer graph of test_generate_loop on the reference backend;
the last ones run a tiny Llama through each compiling backend.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from kiln.backends.executable import BackendOptions
from kiln.backends.reference import ReferenceExecutable
from kiln.runtime.errors import QueueFullError
from kiln.runtime.generate import LLM
from kiln.runtime.request import GenerationSettings, RequestStatus
from test_generate_loop import MAX_SEQ_LEN, tiny_stateful_graph, tokenizer  # noqa: F401 - a fixture

ROWS = 4


class CallLog:
    """An executable wrapper that records (batch, seq, first_row) of every call."""

    def __init__(self, executable):
        self.inner, self.calls = executable, []
        self.options = executable.options

    def run(self, tokens, positions, first_row=0):
        self.calls.append((tokens.size(0), tokens.size(1), first_row))
        return self.inner.run(tokens, positions, first_row)

    def cache_views(self):
        return self.inner.cache_views()


def executable(max_batch: int = ROWS):
    return ReferenceExecutable(
        tiny_stateful_graph(0, max_batch), BackendOptions(max_batch=max_batch, max_seq_len=MAX_SEQ_LEN)
    )


def alone(prompt, prefill_chunk: int | None = None, **kwargs):
    llm = LLM(executable(1))
    llm.engine.prefill_chunk = prefill_chunk or llm.engine.prefill_chunk
    return llm.generate(prompt, **kwargs)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 14))] for _ in range(n)]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=40, seed=5)], ids=["greedy", "sampled"])
def test_sixteen_concurrent_requests_of_mixed_lengths_match_each_run_alone(sampling):
    llm = LLM(executable())
    llm.engine.prefill_chunk = 4  # several chunks per long prompt, interleaved with decode steps
    prompts = mixed_prompts(16)
    lengths = [4 + i % 7 for i in range(16)]
    handles = [None] * 16

    def client(indices):
        for i in indices:
            handles[i] = llm.submit(prompts[i], max_new_tokens=lengths[i], **sampling)

    threads = [threading.Thread(target=client, args=(range(k, 16, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = [h.result(timeout=120) for h in handles]
    expected = [alone(p, max_new_tokens=n, **sampling) for p, n in zip(prompts, lengths)]
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert llm.engine.slots_in_use == 0 and llm.engine.queue_depth == 0


def test_generate_of_a_list_shares_the_rows_and_matches_each_prompt_alone():
    prompts = mixed_prompts(7, seed=1)
    log = CallLog(executable())
    results = LLM(log).generate(prompts, max_new_tokens=6)
    assert [r.token_ids for r in results] == [alone(p, max_new_tokens=6).token_ids for p in prompts]
    assert max(batch for batch, seq, _ in log.calls if seq == 1) > 1  # decode steps served several rows
    assert {row for _, seq, row in log.calls if seq > 1} > {0}  # prefills went to rows beyond the first


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    log = CallLog(executable(2))
    llm = LLM(log)
    llm.engine.prefill_chunk = 4
    with llm.engine.exclusive():  # queue both before the engine starts
        short = llm.submit([7], max_new_tokens=12)
        long = llm.submit(list(range(10, 26)), max_new_tokens=2)
    short.result(timeout=60), long.result(timeout=60)
    chunks = [i for i, (batch, seq, row) in enumerate(log.calls) if seq > 1]
    assert len(chunks) >= 3  # 16 prompt tokens in chunks of 4 (the last one rides in a decode step)
    between = [log.calls[i] for i in range(chunks[0], chunks[-1]) if log.calls[i][1] == 1]
    assert between, "the short request decoded while the long prompt was prefilled"


def test_a_freed_row_admits_the_next_waiting_request_at_once():
    log = CallLog(executable(2))
    llm = LLM(log)
    with llm.engine.exclusive():
        handles = [llm.submit([5 + i, 9], max_new_tokens=n) for i, n in enumerate((2, 10, 3))]
    _, second, third = (h.result(timeout=60) for h in handles)
    assert third.token_ids == alone([7, 9], max_new_tokens=3).token_ids
    assert third.stats.ttft_s < second.stats.ttft_s + second.stats.decode_s  # it started before the 2nd ended
    assert max(batch for batch, _, _ in log.calls) <= 2


def test_a_request_left_in_a_high_row_moves_down_so_decode_calls_narrow():
    log = CallLog(executable())
    llm = LLM(log)
    prompts, lengths = mixed_prompts(4, seed=3), [2, 3, 4, 16]  # rows 0-2 finish long before row 3
    with llm.engine.exclusive():
        handles = [llm.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    results = [h.result(timeout=60) for h in handles]
    expected = [alone(p, max_new_tokens=n).token_ids for p, n in zip(prompts, lengths)]
    assert [r.token_ids for r in results] == expected
    decode_batches = [batch for batch, seq, _ in log.calls if seq == 1]
    assert decode_batches[-1] == 1 and decode_batches.count(1) >= 8  # the last request ran in row 0


def test_a_repeated_prompt_reuses_its_cached_prefix():
    """The reference backend declares no exact_width: a prefix is reused up to a chunk boundary
    (runtime/exact_reuse.py), here all but the last token, which a fresh prefill feeds alone too."""
    log = CallLog(executable())
    llm = LLM(log)
    llm.engine.prefill_chunk = 4
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    first = llm.generate(prompt, max_new_tokens=5)
    fed_before = sum(seq for _, seq, _ in log.calls)
    second = llm.generate(prompt, max_new_tokens=5)
    assert second.token_ids == first.token_ids
    assert second.stats.cached_tokens == len(prompt) - 1
    assert sum(seq for _, seq, _ in log.calls) - fed_before == 5  # the last prompt token + 4 new ones


def test_a_shared_system_prefix_is_copied_from_a_busy_row():
    llm = LLM(executable())
    llm.engine.prefill_chunk = 3  # the system prompt ends at a chunk boundary: exactly reusable
    system = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    with llm.engine.exclusive():
        busy = llm.submit(system + [1], max_new_tokens=8)
    busy.result(timeout=60)
    llm.engine.slots.occupant[0] = "held"  # keep row 0 busy so the next request needs another row
    try:
        other = llm.generate(system + [2, 3], max_new_tokens=5)
    finally:
        llm.engine.slots.release(0)
    assert other.stats.cached_tokens == len(system)
    assert other.token_ids == alone(system + [2, 3], prefill_chunk=3, max_new_tokens=5).token_ids


class NoRowCopies(CallLog):
    """An executable whose KV rows cannot be copied (ORT's buffers on a device torch cannot address)."""

    copies_rows = False

    def cache_views(self):
        raise AssertionError("the engine asked for cache views of an executable that cannot copy rows")


def test_requests_behind_a_prompt_in_prefill_wait_and_copy_it_instead_of_prefilling_it_again():
    log = CallLog(executable())
    llm = LLM(log)
    llm.engine.prefill_chunk = 8
    prompt = list(range(10, 27))  # 17 tokens: two chunks, then the last token alone
    samples = llm.generate([prompt] * 3, max_new_tokens=4, temperature=0.9, seed=[1, 2, 3])
    assert sum(seq for batch, seq, row in log.calls if seq > 1) == len(prompt) - 1  # prefilled once, not 3 times
    assert [s.stats.cached_tokens for s in samples] == [0, len(prompt) - 1, len(prompt) - 1]
    assert [s.token_ids for s in samples] == [
        alone(prompt, prefill_chunk=8, max_new_tokens=4, temperature=0.9, seed=seed).token_ids for seed in (1, 2, 3)
    ]


def test_without_row_copies_a_shared_prefix_is_fed_again_and_the_output_is_unchanged():
    llm = LLM(NoRowCopies(executable()))
    llm.engine.prefill_chunk = 3
    system = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    with llm.engine.exclusive():
        busy = llm.submit(system + [1], max_new_tokens=8)
    busy.result(timeout=60)
    llm.engine.slots.occupant[0] = "held"
    try:
        other = llm.generate(system + [2, 3], max_new_tokens=5)
    finally:
        llm.engine.slots.release(0)
    assert other.stats.cached_tokens == 0
    assert other.token_ids == alone(system + [2, 3], prefill_chunk=3, max_new_tokens=5).token_ids
    again = llm.generate(system + [1], max_new_tokens=8)  # row 0 holds it: reused in place
    assert again.stats.cached_tokens == len(system) and again.token_ids == busy.result().token_ids  # all but the last


def test_cancel_frees_the_row_and_reports_cancelled():
    llm = LLM(executable(1))
    with llm.engine.exclusive():
        handle = llm.submit([3, 4, 5], max_new_tokens=20)
        waiting = llm.submit([6], max_new_tokens=3)
        handle.cancel()
    assert handle.result(timeout=60).finish_reason == "cancelled"
    assert waiting.result(timeout=60).token_ids == alone([6], max_new_tokens=3).token_ids
    assert llm.engine.slots_in_use == 0


def test_a_request_goes_from_waiting_to_running_in_a_kv_row_to_done_cancelled_or_failed(monkeypatch):
    engine = LLM(executable(1)).engine
    settings = GenerationSettings(max_new_tokens=3)
    first, second = (engine.submit(prompt, settings, seed=0, background=False) for prompt in ([3, 4], [5]))
    requests = list(engine.waiting)
    assert [r.status for r in requests] == [RequestStatus.WAITING] * 2
    engine.drive()
    assert (requests[0].status, requests[0].kv_row) == (RequestStatus.RUNNING, 0)
    assert (requests[1].status, requests[1].kv_row) == (RequestStatus.WAITING, None)
    second.cancel()
    while engine.drive():
        pass
    assert requests[0].status is RequestStatus.DONE and first.result().finish_reason == "length"
    assert requests[1].status is RequestStatus.CANCELLED and second.result().finish_reason == "cancelled"
    monkeypatch.setattr(engine.executable, "run", lambda *args, **kwargs: 1 / 0)
    failing = engine.submit([6], settings, seed=0, background=False)
    request = engine.waiting[0]
    engine.drive()
    assert request.status is RequestStatus.FAILED and engine.slots_in_use == 0
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=1)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, seed=5)], ids=["greedy", "sampled"])
def test_prompt_lookup_in_the_engine_gives_each_request_its_output_alone(sampling):
    """Drafts of every decoding request verified in one call, rows padded to the longest draft;
    greedy: the plain tokens; sampled: each request's tokens equal its own speculative run alone
    (the accept/reject draws come from its own generator)."""
    repetitive = [[5 + i % (3 + k) for i in range(9 + k)] for k in range(6)]
    prompts = repetitive + mixed_prompts(4, seed=2)
    llm = LLM(executable())
    llm.engine.prefill_chunk = 4
    together = llm.generate(prompts, max_new_tokens=8, speculative="prompt_lookup", **sampling)
    if not sampling:
        assert [r.token_ids for r in together] == [alone(p, max_new_tokens=8).token_ids for p in prompts]
    assert [r.token_ids for r in together] == [
        alone(p, max_new_tokens=8, speculative="prompt_lookup", **sampling).token_ids for p in prompts
    ]
    assert sum(r.stats.drafted_tokens for r in together) > 0


def test_drafts_that_are_right_are_accepted_several_per_engine_step():
    prompts = mixed_prompts(3, seed=7)
    plain = [alone(p, max_new_tokens=10).token_ids for p in prompts]

    class Knows:  # drafts the plain continuation of its prompt
        def __init__(self, prompt, answer):
            self.prompt, self.answer = prompt, answer

        def propose(self, context, max_tokens):
            done = len(context) - len(self.prompt)
            return self.answer[done : done + min(3, max_tokens)]

        def feedback(self, drafted, accepted):
            pass

    engine = LLM(executable()).engine
    handles = [
        engine.submit(p, GenerationSettings(max_new_tokens=10, drafter_factory=lambda p=p, a=a: Knows(p, a)), seed=0)
        for p, a in zip(prompts, plain)
    ]
    results = [h.result(timeout=60) for h in handles]
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.accepted_tokens == r.stats.drafted_tokens > 0 for r in results)
    assert all(r.stats.target_steps <= 3 for r in results)  # 9 tokens after the first, 4 per step


def test_prompt_lookup_in_the_engine_up_to_the_end_of_the_cache():
    prompt = [5, 6, 7, 8] * 4  # 16 of the 24 slots: drafts run into the end of the cache
    llm = LLM(executable(2))
    results = llm.generate([prompt, [9, 10]], max_new_tokens=20, speculative="prompt_lookup")
    assert [r.token_ids for r in results] == [alone(p, max_new_tokens=20).token_ids for p in (prompt, [9, 10])]
    assert results[0].finish_reason == "context"


def test_speculative_sampling_in_a_request_keeps_the_target_distribution():
    """Request.verify's accept/reject rule: the first emitted token follows the target's
    distribution [0.6, 0.3, 0.1] whatever the draft guesses."""
    import collections

    from kiln.runtime.request import Request
    from kiln.runtime.sampler import SamplingParams

    class Fixed:
        def propose(self, context, max_tokens):
            return [1, 1]

        def feedback(self, drafted, accepted):
            pass

    settings = GenerationSettings(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), drafter_factory=Fixed)
    logits = torch.tensor([0.6, 0.3, 0.1]).log().expand(3, 3)
    counts = collections.Counter()
    for seed in range(1500):
        request = Request([0], settings, seed, max_seq_len=16)
        request.fed = 1  # the prompt is in the cache: the next step drafts
        draft = request.draft(16)
        assert draft.tokens == (1, 1) and draft.is_chain
        request.verify_tree(logits, draft)
        counts[request.tokens[0]] += 1
    for token, p in enumerate([0.6, 0.3, 0.1]):
        assert abs(counts[token] / 1500 - p) < 0.035, counts


def test_a_full_queue_refuses_new_requests():
    llm = LLM(executable(1))
    llm.engine.max_queue = 2
    with llm.engine.exclusive():
        queued = [llm.submit([3], max_new_tokens=2) for _ in range(2)]
        with pytest.raises(QueueFullError, match="2 requests are already waiting"):
            llm.submit([3], max_new_tokens=2)
    assert all(h.result(timeout=60).token_ids == queued[0].result().token_ids for h in queued)


def test_async_iteration_streams_the_text_of_the_result(tokenizer):  # noqa: F811
    llm = LLM(executable(), tokenizer)

    async def consume():
        handles = [llm.submit(text, max_new_tokens=8) for text in ("hello world", "the cat", "a")]
        texts = await asyncio.gather(*[_join(h) for h in handles])
        return texts, [await h.wait() for h in handles]

    texts, results = asyncio.run(consume())
    assert texts == [r.text for r in results] and all(r.token_ids for r in results)


async def _join(handle) -> str:
    return "".join([piece async for piece in handle])


def test_a_failing_model_call_fails_its_requests_and_the_engine_goes_on():
    class Flaky(CallLog):
        def run(self, tokens, positions, first_row=0):
            if tokens[0, 0] == 13:
                raise RuntimeError("the model call failed")
            return super().run(tokens, positions, first_row)

    llm = LLM(Flaky(executable(1)))
    with pytest.raises(RuntimeError, match="model call failed"):
        llm.generate([13, 14], max_new_tokens=3)
    assert llm.generate([20, 21], max_new_tokens=3).token_ids == alone([20, 21], max_new_tokens=3).token_ids


def test_a_failure_while_admitting_a_request_fails_it_alone_and_the_engine_thread_goes_on():
    llm = LLM(executable(1))
    place = llm.engine.slots.place

    def place_or_fail(prompt, chunk):
        if prompt[0] == 13:
            raise RuntimeError("admission failed")
        return place(prompt, chunk)

    llm.engine.slots.place = place_or_fail
    failing = llm.submit([13, 14], max_new_tokens=3)  # the engine thread steps these
    with pytest.raises(RuntimeError, match="admission failed"):
        failing.result(timeout=60)
    assert (
        llm.submit([20, 21], max_new_tokens=3).result(timeout=60).token_ids
        == alone([20, 21], max_new_tokens=3).token_ids
    )
    assert llm.engine.threaded and llm.engine.queue_depth == 0


def test_an_unexpected_error_in_a_step_fails_the_requests_in_flight_not_the_engine(monkeypatch):
    llm = LLM(executable(2))
    with llm.engine.exclusive():
        handles = [llm.submit([5 + i], max_new_tokens=4) for i in range(2)]
        monkeypatch.setattr(llm.engine, "_drop_cancelled", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        handles[0].result(timeout=60)
    with pytest.raises(ZeroDivisionError):
        handles[1].result(timeout=60)
    monkeypatch.undo()
    assert llm.generate([7], max_new_tokens=3).token_ids == alone([7], max_new_tokens=3).token_ids
    assert llm.engine.slots_in_use == 0 and llm.engine.queue_depth == 0


def test_rows_addressed_by_first_row_compute_what_row_zero_computes():
    tokens, positions = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    front, back = executable(), executable()
    want = front.run(tokens, positions)
    got = back.run(tokens, positions, first_row=3)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(back.caches[0][3], front.caches[0][0])
    assert back.caches[0][0].abs().sum() == 0  # row 0 was swapped back untouched
