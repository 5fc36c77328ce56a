"""The generation loop against the reference backend, on a hand-built tiny stateful graph.

The graph is a one-layer attention model written directly in Kiln IR (embedding + position
embedding -> q/k/v -> kv_write into the cache inputs -> attention under the position mask ->
output projection -> logits), so these tests need neither the frontend nor the passes.
"""

from __future__ import annotations

import json

import pytest
import torch

from kiln.backends.executable import BackendOptions
from kiln.backends.reference import ReferenceExecutable
from kiln.ir import Graph, TensorType, symbol
from kiln.runtime.engine_batch import EngineBatch
from kiln.runtime.errors import ContextLengthError
from kiln.runtime.generate import LLM
from kiln.runtime.request import GenerationSettings
from kiln.runtime.stop_strings import StopStringMatcher
from kiln.runtime.tokenizer import Tokenizer
from tiny_models import VOCAB_SIZE, tokenizer_config, tokenizer_json

MAX_BATCH, MAX_SEQ_LEN, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2, 24, 16, 2, 1, 8


def tiny_stateful_graph(seed: int = 0, max_batch: int = MAX_BATCH, paged: tuple[int, int] | None = None) -> Graph:
    """(tokens, positions, cache.k.0, cache.v.0) -> (logits, cache.k.0', cache.v.0'); with
    `paged` = (block_size, num_blocks) the caches are pools read through a `block_table` input."""
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape):
        return torch.randn(*shape, generator=gen) * 0.5

    g = Graph()
    g.add_symbol("batch", 1, max_batch)
    g.add_symbol("seq", 1, MAX_SEQ_LEN)
    b, s = symbol("batch"), symbol("seq")
    tokens = g.add_input("tokens", TensorType("i64", (b, s)))
    positions = g.add_input("positions", TensorType("i64", (b, s)))
    rows, slots = (max_batch, MAX_SEQ_LEN) if paged is None else (paged[1], paged[0])
    cache_type = TensorType("f32", (rows, KV_HEADS, slots, HEAD_DIM))
    cache_k, cache_v = g.add_input("cache.k.0", cache_type), g.add_input("cache.v.0", cache_type)
    table = None if paged is None else g.add_input("block_table", TensorType("i32", (b, MAX_SEQ_LEN // paged[0])))
    embed = g.add_param("embed", weight(VOCAB_SIZE, HIDDEN))
    x = g.call(
        "add",
        g.call("embedding", embed, tokens),
        g.call("embedding", g.add_param("pos_embed", weight(MAX_SEQ_LEN, HIDDEN)), positions),
    )

    def heads(name, n):
        y = g.call("linear", x, g.add_param(name, weight(n * HEAD_DIM, HIDDEN)))
        return g.call("permute", g.call("reshape", y, shape=(b, s, n, HEAD_DIM)), perm=(0, 2, 1, 3))

    q, k, v = heads("wq", HEADS), heads("wk", KV_HEADS), heads("wv", KV_HEADS)
    k_all = g.call("kv_write", cache_k, k, positions, table)
    v_all = g.call("kv_write", cache_v, v, positions, table)
    keys, values = (k_all, v_all) if paged is None else (g.call("kv_pages", c, table) for c in (k_all, v_all))
    attn = g.call("attention", q, keys, values, None, positions)
    merged = g.call("reshape", g.call("permute", attn, perm=(0, 2, 1, 3)), shape=(b, s, HEADS * HEAD_DIM))
    h = g.call("add", x, g.call("linear", merged, g.add_param("wo", weight(HIDDEN, HEADS * HEAD_DIM))))
    head = g.add_param("lm_head", weight(VOCAB_SIZE, HIDDEN))  # untied: tied logits mostly repeat the input
    g.outputs = [g.call("linear", h, head, name="logits"), k_all, v_all]
    if paged is not None:
        block_size, num_blocks = paged
        per_row = MAX_SEQ_LEN // block_size
        g.meta["kv_cache"] = dict(layout="paged", block_size=block_size, num_blocks=num_blocks, blocks_per_row=per_row)
    return g


def executable(seed: int = 0) -> ReferenceExecutable:
    return ReferenceExecutable(tiny_stateful_graph(seed), BackendOptions(max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    (directory / "tokenizer.json").write_text(tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return Tokenizer.from_dir(directory)


LONG, SHORT = [5, 17, 300, 42, 9, 77, 120], [8, 250]


def test_batch_of_two_prompts_of_different_lengths_matches_each_prompt_alone():
    batched = LLM(executable()).generate([LONG, SHORT], max_new_tokens=8)
    alone = [LLM(executable()).generate(p, max_new_tokens=8) for p in (LONG, SHORT)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 8 for r in batched)


def test_padded_prefill_gives_each_row_the_logits_it_gets_alone():
    tokens = torch.tensor([LONG, SHORT + [0] * (len(LONG) - len(SHORT))])
    positions = torch.arange(len(LONG)).expand(2, -1)
    batched = executable().run(tokens, positions)
    short_alone = executable().run(torch.tensor([SHORT]), torch.arange(len(SHORT))[None])
    torch.testing.assert_close(batched[1, : len(SHORT)], short_alone[0], rtol=1e-5, atol=1e-5)


def test_sampled_batch_matches_each_prompt_alone_with_the_same_seed():
    kw = dict(max_new_tokens=8, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    batched = LLM(executable()).generate([LONG, SHORT], **kw)
    alone = [LLM(executable()).generate(p, **kw) for p in (LONG, SHORT)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert LLM(executable()).generate(LONG, **kw).token_ids == alone[0].token_ids


def test_no_cache_reset_is_needed_between_requests():
    llm = LLM(executable())
    llm.generate(LONG + LONG, max_new_tokens=6)  # leaves stale keys in slots 0..19
    assert llm.executable.caches[0][0, :, 15].abs().sum() > 0
    again = llm.generate(SHORT, max_new_tokens=10)
    fresh = LLM(executable()).generate(SHORT, max_new_tokens=10)
    assert again.token_ids == fresh.token_ids


def test_more_prompts_than_max_batch_run_in_chunks():
    prompts = [LONG, SHORT, [3], [400, 401, 402], SHORT[::-1]]
    results = LLM(executable()).generate(prompts, max_new_tokens=4)
    assert [r.token_ids for r in results] == [
        LLM(executable()).generate(p, max_new_tokens=4).token_ids for p in prompts
    ]


def test_prompt_longer_than_max_seq_len_raises_context_length_error():
    with pytest.raises(ContextLengthError, match=f"max_seq_len={MAX_SEQ_LEN}") as info:
        LLM(executable()).generate([1] * (MAX_SEQ_LEN + 1))
    assert info.value.prompt_tokens == MAX_SEQ_LEN + 1 and info.value.max_seq_len == MAX_SEQ_LEN


def test_new_tokens_are_clamped_to_what_fits_in_the_context():
    result = LLM(executable()).generate([1] * (MAX_SEQ_LEN - 2), max_new_tokens=10)
    assert len(result.token_ids) == 3  # slots 22, 23 take fed tokens; the last token is never fed
    assert result.finish_reason == "context" and result.stats.clamped and result.stats.max_new_tokens == 3


def test_a_full_context_prompt_still_gets_one_token():
    assert len(LLM(executable()).generate([1] * MAX_SEQ_LEN, max_new_tokens=5).token_ids) == 1


def test_generation_stops_at_eos_and_keeps_it_in_the_token_ids():
    free = LLM(executable()).generate(LONG, max_new_tokens=8).token_ids
    eos = free[3]
    run = EngineBatch(
        LLM(executable()).engine, [LONG], GenerationSettings(max_new_tokens=8, eos_ids=frozenset({eos})), [0]
    )
    list(run)
    (result,) = run.results()
    assert result.token_ids == free[: free.index(eos) + 1] and result.finish_reason == "eos"


def test_stats_count_tokens_and_record_every_phase():
    result = LLM(executable()).generate(LONG, max_new_tokens=5)
    stats = result.stats
    assert (stats.tokens_in, stats.tokens_out, result.finish_reason) == (len(LONG), 5, "length")
    # every phase was recorded (a value, not a speed claim: speed lives in bench/)
    phases = (stats.ttft_s, stats.prefill_tokens_per_s, stats.decode_tokens_per_s)
    assert None not in phases


def test_text_prompt_stream_concatenates_to_the_result_text(tokenizer):
    llm = LLM(executable(), tokenizer)
    stream = llm.stream("The capital of France", max_new_tokens=12)
    pieces = list(stream)
    assert "".join(pieces) == stream.results.text == llm.generate("The capital of France", max_new_tokens=12).text


def test_stream_of_a_list_yields_prompt_indices(tokenizer):
    llm = LLM(executable(), tokenizer)
    pairs = list(llm.stream(["Once upon", "The quick brown fox", "A"], max_new_tokens=6))
    texts = ["".join(p for i, p in pairs if i == k) for k in range(3)]
    assert texts == [r.text for r in llm.generate(["Once upon", "The quick brown fox", "A"], max_new_tokens=6)]


def test_stop_string_ends_the_text_before_it(tokenizer):
    llm = LLM(executable(), tokenizer)
    full = llm.generate("Once upon a time", max_new_tokens=16).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    result = llm.generate("Once upon a time", max_new_tokens=16, stop=[stop])
    assert result.text == full[: full.index(stop)] and result.finish_reason == "stop"


def test_stop_matcher_holds_back_a_possible_stop_string_start():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.push("hello </") == "hello "
    assert matcher.push("e") == ""
    assert matcher.push("x") == "</ex"
    assert matcher.push("ok</en") == "ok" and matcher.push("d>tail") == "" and matcher.stopped


def test_chat_renders_the_template_without_adding_special_tokens_twice(tokenizer):
    messages = [{"role": "user", "content": "Hi!"}]
    result = LLM(executable(), tokenizer).chat(messages, max_new_tokens=2)
    expected = tokenizer.encode("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert result.prompt_token_ids == expected


def test_stop_token_ids_end_generation_with_reason_stop():
    free = LLM(executable()).generate(LONG, max_new_tokens=8).token_ids
    stopped = LLM(executable()).generate(LONG, max_new_tokens=8, stop_token_ids=[free[2]])
    cut = free.index(free[2]) + 1
    assert stopped.token_ids == free[:cut] and stopped.finish_reason == "stop"


def test_logprobs_are_returned_per_token_when_asked():
    llm = LLM(executable())
    result = llm.generate(LONG, max_new_tokens=4, logprobs=3)
    assert [c.token for c in result.logprobs] == result.token_ids
    assert all(len(c.top) == 3 and c.top[0][0] == c.token for c in result.logprobs)  # greedy: the top one
    assert llm.generate(LONG, max_new_tokens=4).logprobs is None


def test_unknown_sampling_options_name_the_known_ones():
    from kiln.runtime.errors import GenerationError

    with pytest.raises(GenerationError, match="min_p"):
        LLM(executable()).generate(LONG, max_new_tokens=2, nucleus=0.9)


# -- speculative decoding ---------------------------------------------------------------------
REPETITIVE = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]  # prompt lookup finds drafts here


def test_prompt_lookup_greedy_output_is_identical_to_plain_decoding():
    plain = LLM(executable()).generate([LONG, REPETITIVE], max_new_tokens=10)
    spec = LLM(executable()).generate([LONG, REPETITIVE], max_new_tokens=10, speculative="prompt_lookup")
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert spec[1].stats.drafted_tokens > 0 and spec[1].stats.target_steps < 10


def test_a_draft_model_gives_identical_greedy_output_and_reports_acceptance():
    from kiln.runtime.speculative import ModelDrafter

    target = LLM(executable())
    same = ModelDrafter(executable(), threshold=0.0)
    other = ModelDrafter(executable(seed=3), threshold=0.0)
    plain = target.generate(LONG, max_new_tokens=12).token_ids
    perfect = target.generate(LONG, max_new_tokens=12, speculative=same)
    assert perfect.token_ids == plain and perfect.stats.acceptance_rate == 1.0
    assert perfect.stats.tokens_per_target_step > 2
    poor = target.generate(LONG, max_new_tokens=12, speculative=other)
    assert poor.token_ids == plain and poor.stats.acceptance_rate < 1.0


def test_verification_calls_stay_within_the_executables_exact_width():
    """Wider calls may round differently (the Inductor attention kernel's few-queries limit), so
    drafts are cut to what keeps greedy output plain decoding's bit for bit."""
    from kiln.runtime.speculative import ModelDrafter

    target_executable, widths = executable(), []
    target_executable.exact_width = 3
    run = target_executable.run
    target_executable.run = lambda tokens, positions, **kw: (
        widths.append(tokens.shape[1]) or run(tokens, positions, **kw)
    )
    target = LLM(target_executable)
    for prompt, speculative in ((LONG, ModelDrafter(executable(), threshold=0.0)), (REPETITIVE, "prompt_lookup")):
        plain = target.generate(prompt, max_new_tokens=12).token_ids
        widths.clear()
        spec = target.generate(prompt, max_new_tokens=12, speculative=speculative)
        assert spec.token_ids == plain and spec.stats.drafted_tokens > 0
        assert max(widths[1:]) == 3  # after the prompt's call, verification calls of 3 tokens at most


def test_speculative_sampling_keeps_the_target_distribution():
    """The accept/reject rule: emitted tokens follow the target's distribution whatever the draft."""
    import collections

    from kiln.runtime.request import GenerationSettings
    from kiln.runtime.sampler import SamplingParams
    from kiln.runtime.speculative import SpeculativeGeneration

    class Fixed:  # a drafter that always guesses token 1
        def propose(self, context, max_tokens):
            return [1] * min(2, max_tokens)

        def feedback(self, drafted, accepted):
            pass

    class Static:  # a "model" whose next-token distribution is always [0.6, 0.3, 0.1]
        options = BackendOptions(max_batch=1, max_seq_len=MAX_SEQ_LEN)

        def run(self, tokens, positions):
            return torch.tensor([0.6, 0.3, 0.1]).log().expand(*tokens.shape, 3)

    request = GenerationSettings(max_new_tokens=3, sampling=SamplingParams(temperature=1.0))
    counts = collections.Counter()
    for seed in range(1500):
        generation = SpeculativeGeneration(Static(), [0], request, seed, Fixed())
        list(generation)
        counts.update(generation.results()[0].token_ids[1:])  # tokens that went through the rule
    total = sum(counts.values())
    for token, p in enumerate([0.6, 0.3, 0.1]):
        assert abs(counts[token] / total - p) < 0.03, counts
