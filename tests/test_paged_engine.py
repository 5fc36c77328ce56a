"""The engine over a paged KV cache: admission by free blocks, blocks freed at the end, prefix
sharing by reference with copy-on-write, preemption when the pool runs out and resumption; every
request's tokens equal to the same request run alone on the static layout.

The model is test_generate_loop's one-layer graph with the same weights, its caches paged (pools
of BLOCK-slot blocks and a block table), on the reference backend and on ONNX Runtime.
"""

from __future__ import annotations

import random

import pytest

from kiln.backends.executable import BackendOptions
from kiln.backends.reference import ReferenceExecutable
from kiln.ir import Graph
from kiln.runtime.generate import LLM
from test_engine import alone
from test_generate_loop import MAX_SEQ_LEN, tiny_stateful_graph, tokenizer  # noqa: F401 - a fixture

BLOCK = 4
PER_ROW = MAX_SEQ_LEN // BLOCK


def tiny_paged_graph(max_batch: int, num_blocks: int, seed: int = 0) -> Graph:
    """test_generate_loop's tiny_stateful_graph (same weights) with pools and a block table."""
    return tiny_stateful_graph(seed, max_batch, paged=(BLOCK, num_blocks))


def paged_llm(max_batch: int, num_blocks: int, backend: str = "reference") -> LLM:
    options = BackendOptions(max_batch, MAX_SEQ_LEN, kv_layout="paged", kv_block_size=BLOCK, kv_blocks=num_blocks)
    graph = tiny_paged_graph(max_batch, num_blocks)
    if backend == "onnxruntime":  # Kiln's own paged lowering: ScatterND into, GatherND out of the pools
        from kiln.backends import onnxruntime

        return LLM(onnxruntime.lower(graph, options))
    return LLM(ReferenceExecutable(graph, options))


BACKENDS = pytest.mark.parametrize("backend", ["reference", "onnxruntime"])


def prompts_of(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@BACKENDS
def test_requests_beyond_the_pools_blocks_wait_are_preempted_and_resume_token_for_token(backend):
    llm = paged_llm(max_batch=8, num_blocks=13, backend=backend)  # 12 blocks: two full rows' worth for 8 lanes
    llm.engine.prefill_chunk = 5
    prompts = prompts_of(10, seed=3)
    lengths = [3 + i % 9 for i in range(10)]
    with llm.engine.exclusive():  # all queued before the first step
        handles = [llm.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    results = [h.result(timeout=120) for h in handles]
    expected = [alone(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    engine = llm.engine
    assert engine.preemptions > 0  # the pool ran out mid-generation
    assert engine.blocks_in_use == 0 and engine.blocks_free == 12 and engine.slots_in_use == 0  # all given back


@BACKENDS
def test_preemption_frees_the_youngest_requests_blocks_and_requeues_it_first(backend):
    llm = paged_llm(max_batch=3, num_blocks=8, backend=backend)  # 7 blocks: one long request and a bit
    engine = llm.engine
    old = engine.submit(list(range(10, 19)), settings(12), seed=0, background=False)
    young = engine.submit(list(range(30, 37)), settings(12), seed=0, background=False)
    preempted_at = None
    while engine.running or engine.waiting:
        engine.drive()
        held = {id(r): len(engine.slots.blocks[r.kv_row]) for r in engine.running}
        assert sum(held.values()) == engine.blocks_in_use  # nothing shared here: blocks = what rows hold
        if preempted_at is None and engine.waiting and engine.waiting[0].preemptions:
            preempted_at = engine.waiting[0]
            assert preempted_at.fed == 0 and preempted_at.kv_row is None and preempted_at.tokens
    assert preempted_at is not None and preempted_at.handle is young
    assert old.result(timeout=1).token_ids == alone(list(range(10, 19)), max_new_tokens=12).token_ids
    assert young.result(timeout=1).token_ids == alone(list(range(30, 37)), max_new_tokens=12).token_ids
    assert engine.blocks_in_use == 0


def settings(max_new: int):
    from kiln.runtime.request import GenerationSettings

    return GenerationSettings(max_new_tokens=max_new)


@BACKENDS
def test_a_shared_prefix_is_shared_by_block_reference_and_its_partial_block_copied_on_write(backend):
    llm = paged_llm(max_batch=4, num_blocks=20, backend=backend)
    engine = llm.engine
    system = list(range(40, 50))  # two full blocks and two tokens of a third
    first = engine.submit(system + [1, 2], settings(6), seed=0, background=False)
    while engine.waiting or engine.running[0].fed < 12:  # stepped here: no engine thread
        engine.drive()
    second = engine.submit(system + [3], settings(6), seed=0, background=False)
    again = engine.submit(system[:8], settings(6), seed=0, background=False)  # ends at a block's end
    engine.drive()  # admits both
    lanes = {r.handle: r.kv_row for r in engine.running}
    blocks = engine.slots.blocks
    assert blocks[lanes[second]][:2] == blocks[lanes[first]][:2]  # the system prompt's full blocks, shared
    assert blocks[lanes[again]][0] == blocks[lanes[first]][0]
    assert blocks[lanes[again]][1] != blocks[lanes[first]][1]  # its last token is fed again: a private copy
    assert engine.slots.refs[blocks[lanes[first]][0]] == 3
    while engine.running or engine.waiting:
        engine.drive()
    for handle, prompt in ((first, system + [1, 2]), (second, system + [3]), (again, system[:8])):
        result = handle.result(timeout=1)
        assert result.token_ids == alone(prompt, max_new_tokens=6).token_ids
    assert second.result().stats.cached_tokens == 8 and again.result().stats.cached_tokens == 7
    assert engine.blocks_in_use == 0 and engine.slots.registry  # full blocks stay cached when free


def test_health_and_metrics_report_the_pools_blocks(tokenizer):  # noqa: F811
    from fastapi.testclient import TestClient

    from kiln.runtime.server import create_app

    llm = paged_llm(max_batch=2, num_blocks=9)
    llm.tokenizer = tokenizer
    with TestClient(create_app(llm, "tiny")) as client:
        done = client.post("/v1/completions", json=dict(model="tiny", prompt="hello", max_tokens=3, temperature=0))
        assert done.status_code == 200
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert health["kv_blocks_in_use"] == 0 and health["kv_blocks_free"] == 8
    assert "kiln_kv_blocks_in_use 0.0" in metrics and "kiln_kv_blocks_free 8.0" in metrics
    assert "kiln_kv_preemptions_total 0.0" in metrics


def test_a_pool_of_one_rows_blocks_admits_a_full_length_prompt_cached_or_not():
    from kiln.runtime.kv_blocks import KvBlocks

    copies = []
    blocks = KvBlocks(
        2, dict(block_size=4, num_blocks=PER_ROW + 1, blocks_per_row=PER_ROW), lambda *c: copies.append(c)
    )
    prompt = list(range(100, 100 + MAX_SEQ_LEN))
    for attempt in range(2):  # the second time every block is registered, and the last one would need a copy
        placement = blocks.place(prompt)
        assert placement is not None and placement.reused == (0 if attempt == 0 else MAX_SEQ_LEN - BLOCK)
        blocks.occupy(placement.row, "request", prompt, placement.reused)
        assert blocks.blocks_in_use == PER_ROW and blocks.place([1, 2]) is None  # nothing left for another
        blocks.fed(placement.row, prompt[placement.reused :], placement.reused)
        blocks.release(placement.row)
        assert blocks.blocks_in_use == 0 and len(blocks.registry) == PER_ROW
    assert not copies
