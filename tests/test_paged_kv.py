"""The paged KV cache (`kv_layout="paged"`): per layer a pool of blocks, a block table per call;
`kv_write` and `attention` through it on the reference backend, Inductor and ONNX Runtime, checked against the
static layout; the options that ask for it, and what refuses it."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from kiln.backends.errors import FeedError, LoweringError
from kiln.backends.executable import BackendOptions
from kiln.compile_options import CompileOptions, kv_cache_bytes
from kiln.frontend.checkpoint import load_model
from kiln.ir import parse_graph, print_graph
from kiln.ir.errors import OptionError
from kiln.ir.ops.attention import kv_write_reference
from kiln.ir.ops.paged_kv import kv_pages_reference

MAX_BATCH, MAX_SEQ_LEN, BLOCK = 2, 64, 8
STATIC = BackendOptions(MAX_BATCH, MAX_SEQ_LEN)
PAGED = BackendOptions(MAX_BATCH, MAX_SEQ_LEN, kv_layout="paged", kv_block_size=BLOCK, kv_blocks=20)


@functools.cache
def captured_text(model_dir) -> tuple[str, dict]:
    """The tiny model's captured graph as text, with its weights: captured once, parsed per layout."""
    from kiln.frontend.capture import capture_causal_lm

    graph = capture_causal_lm(load_model(model_dir).model, MAX_BATCH, MAX_SEQ_LEN)
    return print_graph(graph), graph.weights


def stateful_graph(model_dir, options: BackendOptions):
    from kiln.passes.pipeline import run_pipeline

    text, weights = captured_text(model_dir)
    graph = parse_graph(text)
    graph.weights = dict(weights)
    return run_pipeline(graph, options)


def test_kv_write_puts_each_token_in_its_rows_block_and_kv_pages_reads_the_row_back():
    pool = torch.zeros(6, 2, 4, 3)
    new = torch.randn(2, 2, 5, 3)
    slots = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    table = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    written = kv_write_reference(pool, new, slots, table)
    torch.testing.assert_close(written[5, :, :4], new[0, :, :4])  # row 0's slots 0-3: its first block
    torch.testing.assert_close(written[2, :, 0], new[0, :, 4])  # slot 4: offset 0 of its second block
    torch.testing.assert_close(written[1, :, 3], new[1, :, 0])  # row 1's slot 3
    torch.testing.assert_close(written[3, :, :4], new[1, :, 1:])  # slots 4-7
    rows = kv_pages_reference(written, table)
    assert rows.shape == (2, 2, 12, 3)
    torch.testing.assert_close(rows[0, :, :5], new[0])
    torch.testing.assert_close(rows[1, :, 3:8], new[1])


def scattered_table(rows: int) -> torch.Tensor:
    """Each row's blocks out of order and interleaved with the other row's (block 0 unused)."""
    order = torch.randperm(19, generator=torch.Generator().manual_seed(1))[: rows * 8] + 1
    return order.reshape(rows, 8).to(torch.int32)


def check_paged_against_static(model, backends, kv_cache: str = "f32") -> list:
    """Prefill two rows in two chunks and decode a token through scattered blocks: the logits of
    each paged executable equal the static layout's on the reference backend."""
    from kiln.backends import reference

    static_options, paged_options = (replace(o, kv_cache=kv_cache) for o in (STATIC, PAGED))
    static = reference.lower(stateful_graph(model, static_options), static_options)
    paged = [backend.lower(stateful_graph(model, paged_options), paged_options) for backend in backends]
    table = scattered_table(2)
    tokens = torch.randint(3, 200, (2, 21), generator=torch.Generator().manual_seed(0))
    calls = [(tokens[:, :13], torch.arange(13)), (tokens[:, 13:20], torch.arange(13, 20)), (tokens[:, 20:], [[20]])]
    for feed, at in calls:
        positions = torch.as_tensor(at).expand(2, -1)
        expected = static.run(feed, positions)
        for executable in paged:
            torch.testing.assert_close(executable.run(feed, positions, block_table=table), expected)
    return [static, *paged]


def test_paged_logits_equal_the_static_layouts_on_the_reference_backend(tiny_model_dirs):
    from kiln.backends import reference

    check_paged_against_static(tiny_model_dirs("llama"), [reference], kv_cache="int8")  # scales paged too
    static, paged = check_paged_against_static(tiny_model_dirs("llama"), [reference])
    assert paged.caches[0].shape == (20, *paged.caches[0].shape[1:]) and paged.max_seq_len == MAX_SEQ_LEN
    one = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(FeedError, match="needs block_table"):
        paged.run(one, one)
    with pytest.raises(FeedError, match="outside"):
        paged.run(one, one, block_table=scattered_table(2) + 20)
    with pytest.raises(FeedError, match="static rows"):
        static.run(one, one, block_table=scattered_table(2))


@pytest.mark.slow
def test_paged_logits_on_inductor_equal_the_static_layouts(tiny_model_dirs):
    from kiln.backends.inductor import executable as inductor

    check_paged_against_static(tiny_model_dirs("llama"), [inductor])


def options(**given):
    return CompileOptions.checked(model=None, out="/tmp/kiln-paged-options.kiln", **given)


def test_the_paged_layout_is_a_checked_option():
    paged = options(kv_layout="paged", kv_block_size=16, kv_blocks=9, max_seq_len=128)
    assert paged.backend_options().kv_layout == "paged" and paged.backend_options().kv_blocks == 9
    assert options(kv_layout="paged", backend="onnxruntime").backend_options().kv_layout == "paged"
    with pytest.raises(OptionError, match="--kv-layout static"):
        options(kv_layout="paged", backend="tinygrad")
    with pytest.raises(OptionError, match="kv_layout 'rows'"):
        options(kv_layout="rows")
    with pytest.raises(OptionError, match="cannot hold one sequence"):
        options(kv_layout="paged", kv_block_size=16, kv_blocks=8, max_seq_len=128)
    config = type("Config", (), dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64))
    static_bytes = kv_cache_bytes(config, options(max_batch=4, max_seq_len=128))
    pool_bytes = kv_cache_bytes(config, options(max_batch=4, max_seq_len=128, kv_layout="paged", kv_block_size=16))
    assert pool_bytes - static_bytes == 2 * 2 * 4 * 16 * 16 * 4  # the default pool: the rows and a scratch block


def test_paged_logits_on_onnxruntime_equal_the_static_layouts(tiny_model_dirs):
    import onnx

    from kiln.backends import onnxruntime

    _, paged = check_paged_against_static(tiny_model_dirs("llama"), [onnxruntime])
    assert paged.info["paged"]["blocks_per_row"] == 8 and all(c["in_place"] for c in paged.info["caches"])
    nodes = onnx.load(str(paged.model_path), load_external_data=False).graph.node
    assert {"ScatterND", "GatherND"} <= {n.op_type for n in nodes} and "GroupQueryAttention" not in str(nodes)
    with pytest.raises(FeedError, match="needs block_table"):
        paged.run(torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64))


def test_backends_without_a_paged_cache_refuse_its_graph(tiny_model_dirs):
    from kiln.backends.paged_feeds import refuse_paged

    with pytest.raises(LoweringError, match="cannot run a paged KV cache.*--kv-layout static"):
        refuse_paged(stateful_graph(tiny_model_dirs("llama"), PAGED), "tinygrad")


@pytest.mark.parametrize(
    "seq,int8,with_tree", [(1, False, False), (3, True, True), (24, False, True), (20, True, False)]
)
def test_the_kernel_reads_a_paged_cache_through_its_block_table(seq, int8, with_tree):
    import math

    from kiln.backends.inductor import fast_attention
    from kiln.ir.ops.attention import attention_reference
    from kiln.ir.ops.kv_quant import kv_quantize_reference

    if not fast_attention.kernel_available():
        pytest.skip("the attention kernel cannot be built here")
    generator = torch.Generator().manual_seed(seq)
    batch, heads, kv_heads, head_dim, block = 2, 6, 3, 32, 8
    q = torch.randn(batch, heads, seq, head_dim, generator=generator)
    pools = [torch.randn(12, kv_heads, block, head_dim, generator=generator) for _ in range(2)]
    table = torch.tensor([[7, 2, 9, 0, 0, 0], [1, 11, 4, 5, 3, 0]], dtype=torch.int32)
    positions = torch.tensor([[5], [30 - seq]]) + torch.arange(seq)
    tree = torch.rand(batch, seq, seq, generator=generator).tril() > 0.4 if with_tree else None
    if tree is not None:
        tree |= torch.eye(seq, dtype=torch.bool)
    scales = [None, None]
    if int8:
        (pools[0], scales[0]), (pools[1], scales[1]) = (kv_quantize_reference(pool) for pool in pools)
    rows = [kv_pages_reference(t, table) if t is not None else None for t in (*pools, *scales)]
    expected = attention_reference(
        q, rows[0], rows[1], None, positions, tree, rows[2], rows[3], scale=None, causal=False, window=0, softcap=0.0
    )
    scale = 1 / math.sqrt(head_dim)
    actual = torch.ops.kiln.cached_attention(q, *pools, positions, scale, 0, tree, *scales, table)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
