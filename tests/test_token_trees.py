"""A token tree verified in one step: every node's logits equal those of its path run as one
sequence, on each architecture (reference backend) and on Inductor's kernel (few and many
queries); the tree's tokens sit in consecutive slots at the positions of their depths."""

from __future__ import annotations

import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import kiln
from hf_oracle import prompts
from kiln.backends.errors import FeedError
from kiln.backends.executable import BackendOptions
from kiln.backends.token_trees import has_token_trees, verifies_trees
from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.request import GenerationSettings, Request
from tiny_models import ARCHITECTURES

MAX_SEQ_LEN = 64
OPTIONS = BackendOptions(max_batch=2, max_seq_len=MAX_SEQ_LEN)


@functools.cache
def compiled(source: Path, backend: str):
    root = Path(tempfile.mkdtemp(prefix="kiln_tree_"))
    path = kiln.compile(str(source), out=root / "model.kiln", backend=backend, max_seq_len=MAX_SEQ_LEN, max_batch=2)
    llm = kiln.load(path)
    shutil.rmtree(root, ignore_errors=True)
    return llm


def random_tree(size: int, seed: int) -> list[int]:
    """parents[i] < i (-1: a child of the prompt's last token): a random tree in topological order."""
    generator = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) if i > 1 else 0 for i in range(1, size)]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_inputs(parents: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, slots, tree) of the tree's tokens after `length` tokens of a row."""
    size = len(parents)
    tree = torch.zeros(size, size, dtype=torch.bool)
    for node in range(size):
        tree[node, path_to(parents, node)] = True
    depths = tree.sum(dim=1) - 1
    return (length + depths)[None], (length + torch.arange(size))[None], tree[None]


def check_tree_equals_paths(llm, size: int, seed: int) -> None:
    (prompt,) = prompts([5], seed=seed)
    vocab = llm.manifest["model"]["vocab_size"] if "model" in llm.manifest else 100
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, min(vocab, 100), (1, size), generator=generator)
    parents = random_tree(size, seed)
    executable = llm.executable
    executable.reset()
    executable.run(torch.tensor([prompt]), torch.arange(len(prompt))[None])
    positions, slots, tree = tree_inputs(parents, len(prompt))
    logits = executable.run(tokens, positions, slots=slots, tree=tree)[0]
    for node in range(size):
        path = path_to(parents, node)
        sequence = torch.tensor([prompt + tokens[0, path].tolist()])
        want = executable.run(sequence, torch.arange(sequence.size(1))[None], first_row=1)[0, -1]
        torch.testing.assert_close(logits[node], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_logits_equal_each_path_run_alone(tiny_model_dirs, arch):
    llm = compiled(tiny_model_dirs(arch), "reference")
    assert has_token_trees(llm.graph)
    if not verifies_trees(llm.graph):  # a sliding window shorter than the cache: distances in slots
        assert any(n.op == "attention" and n.attrs["window"] for n in llm.graph.nodes)
        return
    check_tree_equals_paths(llm, size=6, seed=1)


@pytest.mark.parametrize("size", [1, 5, 16, 23])  # the kernel's few-queries path, and SDPA's from 17
def test_inductor_kernel_verifies_trees(tiny_model_dirs, size):
    llm = compiled(tiny_model_dirs("llama"), "inductor")
    check_tree_equals_paths(llm, size=size, seed=size)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])  # GQA with RoPE folded, GQA with a bias, plain ONNX
def test_onnxruntime_verifies_trees(tiny_model_dirs, arch):
    llm = compiled(tiny_model_dirs(arch), "onnxruntime")
    assert llm.executable.token_trees and llm.executable.verifies_trees
    check_tree_equals_paths(llm, size=7, seed=3)


@pytest.mark.parametrize("contrib_ops", [True, False])  # GroupQueryAttention's bias; plain ONNX's mask
def test_onnxruntime_tree_logits_equal_the_reference_backend(tiny_model_dirs, contrib_ops):
    from kiln.backends import onnxruntime as ort_backend
    from kiln.backends import reference

    graph = compiled(tiny_model_dirs("llama"), "reference").graph
    executable = ort_backend.lower(graph, OPTIONS, contrib_ops=contrib_ops)
    assert ("GroupQueryAttention" in {n.op_type for n in onnx_nodes(executable)}) == contrib_ops
    oracle = reference.lower(graph, OPTIONS)
    (prompt,) = prompts([6], seed=5)
    positions, slots, tree = tree_inputs(random_tree(6, 5), len(prompt))
    tokens = torch.arange(3, 9)[None]
    for runner in (executable, oracle):
        runner.run(torch.tensor([prompt]), torch.arange(len(prompt))[None])
    torch.testing.assert_close(
        executable.run(tokens, positions, slots=slots, tree=tree),
        oracle.run(tokens, positions, slots=slots, tree=tree),
        atol=1e-4,
        rtol=1e-4,
    )


def onnx_nodes(executable):
    import onnx

    return onnx.load(str(executable.model_path), load_external_data=False).graph.node


def test_onnxruntime_refuses_a_first_prompt_at_positions_apart_from_its_slots(tiny_model_dirs):
    llm = compiled(tiny_model_dirs("llama"), "onnxruntime")
    positions, slots, tree = tree_inputs([-1, 0, 0], 0)
    with pytest.raises(FeedError, match="first tokens"):
        llm.executable.run(torch.ones(1, 3, dtype=torch.long), positions, slots=slots, tree=tree)
    with pytest.raises(FeedError, match="slots must be contiguous"):
        llm.executable.run(torch.ones(1, 3, dtype=torch.long), positions + 4, slots=slots + torch.tensor([4, 5, 7]))


def test_a_lower_triangular_tree_is_a_plain_call(tiny_model_dirs):
    llm = compiled(tiny_model_dirs("qwen2"), "reference")
    (prompt,) = prompts([9], seed=4)
    ids, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
    llm.executable.reset()
    plain = llm.executable.run(ids, positions)
    llm.executable.reset()
    given = llm.executable.run(
        ids, positions, slots=positions.clone(), tree=torch.ones(1, 9, 9, dtype=torch.bool).tril()
    )
    torch.testing.assert_close(given, plain, atol=0, rtol=0)


def test_a_misshapen_tree_is_refused(tiny_model_dirs):
    llm = compiled(tiny_model_dirs("llama"), "reference")
    positions = torch.arange(3)[None]
    with pytest.raises(FeedError, match="tree must be bool"):
        llm.executable.run(torch.ones(1, 3, dtype=torch.long), positions, tree=torch.ones(1, 3, 2, dtype=torch.bool))


def test_draft_trees_merge_continuations_and_keep_what_the_model_knows():
    tree = DraftTree.of_continuations([[4, 5, 6], [4, 7], [8]], max_nodes=10)
    assert tree.tokens == (4, 5, 6, 7, 8) and tree.parents == (-1, 0, 1, 0, -1)
    assert tree.depths() == [1, 2, 3, 2, 1] and tree.first_path() == [4, 5, 6] and not tree.is_chain
    assert DraftTree.of_continuations([[4, 5, 6], [4, 7]], max_nodes=3).tokens == (4, 5, 6)
    kept = tree.within(vocab_size=7, max_nodes=10)  # 7 and 8 are no ids of a 7-token vocabulary
    assert kept.tokens == (4, 5, 6) and kept.is_chain
    seen = tree.visibility()  # over the newest token, then the nodes
    assert seen[3].tolist() == [True, True, True, True, False, False]  # node 2 (6) sees 4, 5, itself
    assert seen[4].tolist() == [True, True, False, False, True, False]  # node 3 (7) sees 4 and itself


class KnowsOnASideBranch:
    """Drafts a tree whose first branch is wrong and whose second is the plain continuation, so
    every accepted node sits off the chain's slots and must be moved."""

    def __init__(self, prompt, answer):
        self.prompt, self.answer = prompt, answer

    def propose(self, context, max_tokens):
        done = len(context) - len(self.prompt)
        right = self.answer[done : done + min(3, max_tokens)]
        wrong = [(token + 1) % 50 + 3 for token in right]
        return DraftTree.of_continuations([wrong[:2], right], max_nodes=8)

    def feedback(self, drafted, accepted):
        pass


@pytest.mark.parametrize(
    "backend", ["reference", "inductor", "onnxruntime", pytest.param("tinygrad", marks=pytest.mark.slow)]
)
def test_trees_in_the_engine_equal_plain_greedy(tiny_model_dirs, backend, monkeypatch):
    llm = compiled(tiny_model_dirs("llama"), backend)
    assert llm.engine.verifies_trees
    batch = [prompts([7], seed=2)[0], prompts([4], seed=6)[0]]
    plain = [r.token_ids for r in llm.generate(batch, max_new_tokens=12, ignore_eos=True)]
    settings = [
        GenerationSettings(max_new_tokens=12, drafter_factory=lambda p=p, a=a: KnowsOnASideBranch(p, a))
        for p, a in zip(batch, plain)
    ]
    handles = [llm.engine.submit(p, s, seed=0) for p, s in zip(batch, settings)]
    results = [h.result(timeout=120) for h in handles]
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.accepted_tokens >= 8 and r.stats.target_steps <= 4 for r in results)
    lookup = llm.generate([branching_prompt() * 2], max_new_tokens=12, ignore_eos=True, speculative="prompt_lookup")
    assert (
        lookup[0].token_ids == llm.generate([branching_prompt() * 2], max_new_tokens=12, ignore_eos=True)[0].token_ids
    )


@pytest.mark.parametrize("backend", ["inductor", "onnxruntime", pytest.param("tinygrad", marks=pytest.mark.slow)])
def test_drafts_up_to_the_end_of_the_cache_keep_every_rows_slots_consecutive(tiny_model_dirs, backend):
    """Near the end of the cache the call narrows to the room left (ONNX Runtime and tinygrad need
    consecutive slots per row): a request runs into the end beside a short one and an idle row."""
    llm = compiled(tiny_model_dirs("llama"), backend)
    batch = [branching_prompt() * 3, prompts([5], seed=9)[0]]  # 51 of the 64 slots, and a short one
    plain = [r.token_ids for r in llm.generate(batch, max_new_tokens=20, ignore_eos=True)]
    drafted = llm.generate(batch, max_new_tokens=20, ignore_eos=True, speculative="prompt_lookup")
    assert [r.token_ids for r in drafted] == plain
    assert drafted[0].finish_reason == "context"


def branching_prompt() -> list[int]:
    """'5 6' is followed by three different pairs: prompt lookup drafts trees."""
    return [5, 6, 7, 8, 9, 5, 6, 10, 11, 12, 5, 6, 13, 14, 15, 5, 6]


def test_sampling_among_several_drafted_children_keeps_the_target_distribution():
    """Request.judge over the children [1, 2]: the emitted token follows [0.6, 0.3, 0.1]."""
    import collections

    from kiln.runtime.sampler import SamplingParams

    class Branches:
        def propose(self, context, max_tokens):
            return DraftTree.of_continuations([[1], [2]], max_nodes=4)

        def feedback(self, drafted, accepted):
            pass

    settings = GenerationSettings(max_new_tokens=4, sampling=SamplingParams(temperature=1.0), drafter_factory=Branches)
    logits = torch.tensor([0.6, 0.3, 0.1]).log().expand(3, 3)
    counts = collections.Counter()
    for seed in range(1500):
        request = Request([0], settings, seed, max_seq_len=16)
        request.fed = 1
        tree = request.draft(16, trees=True)
        assert tree.parents == (-1, -1)
        request.verify_tree(logits, tree)
        counts[request.tokens[0]] += 1
    for token, p in enumerate([0.6, 0.3, 0.1]):
        assert abs(counts[token] / 1500 - p) < 0.035, counts


def test_tinygrad_verifies_trees(tiny_model_dirs):
    """The tree step (symbolic length and start per row) against each path run alone by the plain steps."""
    pytest.importorskip("tinygrad")
    llm = compiled(tiny_model_dirs("llama"), "tinygrad")
    assert has_token_trees(llm.graph)
    for size in (5, 16):
        check_tree_equals_paths(llm, size=size, seed=size)


def test_tinygrad_trees_follow_the_reference_row_by_row(tiny_model_dirs):
    """Two rows at their own slots, positions apart from slots, trees that hide a token from itself
    and one that hides every key from a query (zeros, as the reference gives); one token alone."""
    pytest.importorskip("tinygrad")
    source = tiny_model_dirs("llama")
    tinygrad, oracle = compiled(source, "tinygrad").executable, compiled(source, "reference").executable
    generator = torch.Generator().manual_seed(0)
    for executable in (tinygrad, oracle):
        executable.reset()
        executable.run(torch.arange(3, 10)[None].repeat(2, 1), torch.arange(7)[None].repeat(2, 1))
    for seq, starts in [(4, (7, 9)), (1, (20, 3)), (3, (0, 7))]:  # row 0 of the last from slot 0
        tokens = torch.randint(3, 50, (2, seq), generator=generator)
        slots = torch.stack([start + torch.arange(seq) for start in starts])
        positions = torch.randint(0, 20, (2, seq), generator=generator)
        tree = torch.rand(2, seq, seq, generator=generator) > 0.4
        tree[:, 0, 0] = False
        got, want = (e.run(tokens, positions, slots=slots, tree=tree) for e in (tinygrad, oracle))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for got, want in zip(tinygrad.cache_views(), oracle.cache_views()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tinygrad_generic_attention_applies_the_tree():
    """Caches as plain inputs (no start variables): attention over all slots under the tree, as
    the IR's reference does, for positions that need not be consecutive."""
    pytest.importorskip("tinygrad")
    from tinygrad import Tensor

    from kiln.backends.tinygrad.graph_to_tensors import LoweringContext, graph_to_tensors
    from kiln.ir import run_graph
    from test_inductor_backend import build_op_graph, random_feeds

    case = {
        "tree": (
            [
                "q: f32[batch, 4, seq, 8]",
                "k: f32[3, 2, 9, 8]",
                "v: f32[3, 2, 9, 8]",
                "p: i64<9[batch, seq]",
                "t: bool[batch, seq, seq]",
            ],
            lambda g, q, k, v, p, t: g.call("attention", q, k, v, None, p, t),
        )
    }
    graph = build_op_graph(case)
    feeds = random_feeds(graph, case, batch=2, seq=4)
    want = run_graph(graph, [f.clone() for f in feeds])[0]
    tensors = {v.name: Tensor(f.numpy()) for v, f in zip(graph.inputs, feeds)}
    got = graph_to_tensors(graph, tensors, LoweringContext({"batch": 2, "seq": 4}))[0]
    torch.testing.assert_close(torch.from_numpy(got.numpy()), want, atol=1e-5, rtol=1e-5)


def test_tinygrad_refuses_a_tree_it_cannot_run(tiny_model_dirs):
    pytest.importorskip("tinygrad")
    from kiln.backends.executable import BackendOptions
    from kiln.backends.tinygrad import TinygradExecutable

    graph = compiled(tiny_model_dirs("llama"), "tinygrad").graph
    options = BackendOptions(max_seq_len=MAX_SEQ_LEN)
    executable = TinygradExecutable(graph, options, prefill_chunk=2)  # refused before any step compiles
    tokens, positions = torch.ones(1, 3, dtype=torch.long), torch.tensor([[4, 5, 5]])
    tree = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    with pytest.raises(FeedError, match="slots consecutive"):
        executable.run(tokens, positions, slots=torch.tensor([[4, 5, 7]]), tree=tree)
    tree[0, 2, 1] = False  # the second chunk (token 2) must see the whole first (tokens 0, 1)
    with pytest.raises(FeedError, match="earlier chunk"):
        executable.run(tokens, positions, slots=torch.tensor([[4, 5, 6]]), tree=tree)
    assert not executable.steps
