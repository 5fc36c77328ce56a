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
from kiln.backends.token_trees import has_token_trees, verifies_trees
from tiny_models import ARCHITECTURES

MAX_SEQ_LEN = 64


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
