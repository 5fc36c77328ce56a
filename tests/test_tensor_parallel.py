"""Tensor parallelism: a sharded SmolLM2-shaped model generates what the unsharded one does.

The tiny llama (SmolLM2's shape: GQA with 4 query and 2 KV heads, RoPE, SwiGLU, tied embeddings)
is compiled with --tensor-parallel 2 and 4 (4 ranks replicate each KV head on two ranks), the tiny
qwen2 (q/k/v biases, untied lm_head) with 2, and run by torchrun on CPU with gloo, one process
per rank; greedy tokens must equal the unsharded artifact's, token for token, on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import kiln
from kiln.backends.executable import BackendOptions
from kiln.ir import run_graph
from kiln.passes.shard_tensor_parallel import ShardingError, shard_tensor_parallel
from kiln.runtime.distributed import TensorParallelError

MAX_SEQ_LEN, NEW_TOKENS = 64, 16
PROMPT = "The capital of France is"
WORKER = """\
import json, sys
import torch.distributed as dist
import kiln
llm = kiln.load(sys.argv[1])
ids = llm.generate(sys.argv[2], max_new_tokens=int(sys.argv[3]), ignore_eos=True).token_ids
with open(f"{sys.argv[4]}.rank{dist.get_rank()}.json", "w") as f:
    json.dump(ids, f)
"""


@pytest.fixture(scope="module")
def artifacts(tiny_model_dirs, tmp_path_factory):
    """(backend, ranks, arch) -> artifact path of a tiny model, compiled once per module."""
    cache = {}

    def get(backend: str, ranks: int, arch: str = "llama"):
        if (backend, ranks, arch) not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-tp{ranks}") / f"{backend}.kiln"
            cache[backend, ranks, arch] = kiln.compile(
                str(tiny_model_dirs(arch)), out=out, backend=backend, max_seq_len=MAX_SEQ_LEN, tensor_parallel=ranks
            )
        return cache[backend, ranks, arch]

    return get


def greedy_ids(path) -> list[int]:
    return kiln.load(path).generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids


@pytest.fixture(scope="module")
def unsharded_ids(artifacts) -> list[int]:
    return greedy_ids(artifacts("reference", 1))


@pytest.fixture(scope="module")
def stateful_graph(tiny_model_dirs):
    """The tiny llama after the whole pass pipeline (fused, stateful)."""
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.passes.pipeline import run_pipeline

    options = BackendOptions(max_seq_len=MAX_SEQ_LEN)
    graph = capture_causal_lm(load_model(tiny_model_dirs("llama")).model, max_batch=1, max_seq_len=MAX_SEQ_LEN)
    return run_pipeline(graph, options)


def torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def run_ranks(path, ranks: int, tmp_path) -> list[list[int]]:
    """Greedy token ids of every rank of a torchrun job running the Python API on `path`."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = torchrun(ranks, str(script), str(path), PROMPT, str(NEW_TOKENS), str(tmp_path / "ids"))
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"ids.rank{rank}.json").read_text()) for rank in range(ranks)]


# -- the pass ------------------------------------------------------------------------------
def test_kv_buffers_and_projections_shrink_to_each_ranks_heads(stateful_graph):
    full_cache = stateful_graph.inputs[2].type.shape  # [batch, 2 kv heads, seq, head_dim]
    for ranks, kv_heads in ((2, 1), (4, 1)):
        shard = shard_tensor_parallel(stateful_graph, rank=0, world_size=ranks)
        assert shard.inputs[2].type.shape == (full_cache[0], kv_heads, *full_cache[2:])
        assert {n.op for n in shard.nodes} >= {"all_reduce", "all_gather"}
        # two all_reduce per layer (o_proj, down) plus the masked embedding's; one all_gather (logits)
        ops = [n.op for n in shard.nodes]
        assert ops.count("all_reduce") == 2 * 2 + 1 and ops.count("all_gather") == 1


def test_rank_shards_put_back_together_are_the_original_weights(stateful_graph):
    name = "model.layers.0.mlp.down_proj.weight"
    shards = [shard_tensor_parallel(stateful_graph, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat([s.weights[name] for s in shards], dim=1), stateful_graph.weights[name])
    assert str(shards[0]) == str(shards[1])  # one graph for every rank: only the weights differ


def test_sharding_is_the_pipelines_last_phase(tiny_model_dirs, stateful_graph):
    """With tensor_parallel N the pipeline ends in a `shard` phase: rank 0's graph, the other ranks'
    weights in the list it is given, as shard_tensor_parallel makes them."""
    from types import SimpleNamespace

    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.passes.pipeline import default_pipeline

    options = SimpleNamespace(max_batch=1, max_seq_len=MAX_SEQ_LEN, tensor_parallel=2)
    with pytest.raises(ShardingError, match="rank_weights"):
        default_pipeline(options)
    rank_weights = []
    pipeline = default_pipeline(options, rank_weights=rank_weights)
    assert [phase for phase, _ in pipeline.phases][-2:] == ["cleanup", "shard"]
    graph = capture_causal_lm(load_model(tiny_model_dirs("llama")).model, max_batch=1, max_seq_len=MAX_SEQ_LEN)
    sharded = pipeline.run(graph)
    expected = [shard_tensor_parallel(stateful_graph, rank, 2) for rank in range(2)]
    assert str(sharded) == str(expected[0]) and len(rank_weights) == 1
    for name, weight in expected[1].weights.items():
        assert torch.equal(rank_weights[0][name], weight)
    assert [phase for phase, _ in default_pipeline(BackendOptions()).phases][-1] == "cleanup"


def test_four_ranks_replicate_each_kv_head_on_the_ranks_that_read_it(stateful_graph):
    qkv = next(name for name in stateful_graph.params if "q_proj-k_proj-v_proj" in name)
    full = stateful_graph.weights[qkv]  # rows: 4 q heads, 2 k heads, 2 v heads of 16
    for rank in range(4):
        rows = shard_tensor_parallel(stateful_graph, rank, 4).weights[qkv]
        kv_head = rank // 2
        expected = torch.cat(
            [
                full[16 * rank : 16 * (rank + 1)],
                full[64 + 16 * kv_head : 64 + 16 * (kv_head + 1)],
                full[96 + 16 * kv_head : 96 + 16 * (kv_head + 1)],
            ]
        )
        assert torch.equal(rows, expected)


def test_head_counts_that_do_not_split_are_refused(stateful_graph):
    with pytest.raises(ShardingError, match="3 ranks"):
        shard_tensor_parallel(stateful_graph, rank=0, world_size=3)


def test_onnxruntime_and_tinygrad_refuse_a_sharded_graph(stateful_graph, tmp_path, tiny_model_dirs):
    shard = shard_tensor_parallel(stateful_graph, rank=0, world_size=2)
    pytest.importorskip("onnxruntime")
    from kiln.backends.onnxruntime import graph_to_onnx

    with pytest.raises(Exception, match="cannot run a tensor-parallel graph"):
        graph_to_onnx(shard)
    with pytest.raises(ShardingError, match="tinygrad backend cannot run a tensor-parallel graph"):
        kiln.compile(str(tiny_model_dirs("llama")), out=tmp_path / "x.kiln", backend="tinygrad", tensor_parallel=2)


class ThreadRanks:
    """Ranks run side by side in threads, their collectives met at a barrier (no process group)."""

    def __init__(self, world_size: int):
        self.barrier, self.slots, self.local = threading.Barrier(world_size), [None] * world_size, threading.local()

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = x
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before any writes its next
        return gathered

    def all_reduce(self, x, world_size):
        return torch.stack(self._exchange(x)).sum(0)

    def all_gather(self, x, axis, world_size):
        return torch.cat(self._exchange(x), dim=axis)

    def run(self, shards, feeds) -> list[torch.Tensor]:
        results = [None] * len(shards)

        def rank_main(rank):
            self.local.rank = rank
            caches = {v.name: torch.zeros(tuple(v.type.shape)) for v in shards[rank].inputs[2:]}
            results[rank] = run_graph(shards[rank], {**feeds, **caches})[0]

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(len(shards))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def test_a_sharded_mixture_of_experts_gives_the_unsharded_logits(tiny_model_dirs, monkeypatch):
    """Mixtral's experts split like a dense MLP over 2 ranks (each expert's gate/up rows, down
    columns): the ranks together give the unsharded model's logits."""
    from kiln.frontend.capture import capture_causal_lm
    from kiln.frontend.checkpoint import load_model
    from kiln.ir import registry
    from kiln.passes.pipeline import run_pipeline

    model = load_model(tiny_model_dirs("mixtral")).model
    graph = run_pipeline(
        capture_causal_lm(model, max_batch=1, max_seq_len=MAX_SEQ_LEN), BackendOptions(max_seq_len=MAX_SEQ_LEN)
    )
    shards = [shard_tensor_parallel(graph, rank, 2) for rank in range(2)]
    down, gate_up = (f"model.layers.0.mlp.experts.{name}" for name in ("down_proj", "gate_up_proj"))
    assert torch.equal(torch.cat([s.weights[down] for s in shards], dim=2), graph.weights[down])
    gate, up = graph.weights[gate_up].chunk(2, dim=1)  # rank r: its half of the gate rows, then of the up rows
    assert torch.equal(shards[1].weights[gate_up], torch.cat([gate.chunk(2, dim=1)[1], up.chunk(2, dim=1)[1]], 1))
    ranks = ThreadRanks(2)
    for name in ("all_reduce", "all_gather"):
        op = registry.get_op(name)
        monkeypatch.setitem(registry._REGISTRY, name, dataclasses.replace(op, reference=getattr(ranks, name)))
    tokens = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    feeds = {"tokens": tokens, "positions": torch.arange(9)[None]}
    expected = run_graph(graph, {**feeds, **{v.name: torch.zeros(tuple(v.type.shape)) for v in graph.inputs[2:]}})[0]
    for logits in ranks.run(shards, feeds):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


# -- artifacts under torchrun --------------------------------------------------------------
def test_a_sharded_artifact_outside_torchrun_says_how_to_run_it(artifacts, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    path = artifacts("reference", 2)
    assert json.loads((path / "manifest.json").read_text())["tensor_parallel"] == 2
    with pytest.raises(TensorParallelError, match="torchrun --nproc-per-node 2"):
        kiln.load(path)


@pytest.mark.slow
@pytest.mark.parametrize("arch, ranks", [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_sharded_greedy_tokens_equal_unsharded_on_every_rank(artifacts, arch, ranks, tmp_path):
    expected = greedy_ids(artifacts("reference", 1, arch))
    assert run_ranks(artifacts("reference", ranks, arch), ranks, tmp_path) == [expected] * ranks


@pytest.mark.slow
def test_inductor_shards_generate_the_unsharded_tokens_and_kiln_generate_prints_them_once(
    artifacts, unsharded_ids, tmp_path
):
    # Two jobs on one artifact: the second finds the first's kernels in Inductor's cache, and
    # must still run each rank's own weights.
    path = artifacts("inductor", 2)
    assert run_ranks(path, 2, tmp_path) == [unsharded_ids] * 2
    expected = kiln.load(artifacts("reference", 1)).generate(PROMPT, max_new_tokens=NEW_TOKENS)
    result = torchrun(2, "-m", "kiln", "generate", str(path), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected.text + "\n"
