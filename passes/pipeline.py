"""The default compilation pipeline: one ordered list of passes, grouped in phases.

Read it top to bottom to know what the compiler does to a captured graph, from capture to the
graph a backend lowers (tensor-parallel sharding included). With `dump_dir`, the IR is written
after each phase (`00-captured.kir`, `01-canonicalize.kir`, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.ir import Graph

from .canonicalize import canonicalize
from .constant_fold import fold_constants
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .fold_linear_reshapes import fold_linear_reshapes
from .fold_norm_casts import fold_norm_casts
from .fold_transposes import fold_transposes
from .fuse_add_rms_norm import fuse_add_rms_norm
from .fuse_attention_pattern import fuse_attention_pattern
from .fuse_bias_activation import fuse_bias_activation
from .fuse_gathered_matmul import fuse_gathered_matmul
from .fuse_layer_norm import fuse_layer_norm
from .fuse_projections import fuse_projections
from .fuse_rms_norm import fuse_rms_norm
from .fuse_rope import fuse_rope
from .manager import Pass, PassManager, PassRecord
from .quantize_phase import quantization_passes
from .shard_tensor_parallel import ShardingError, shard_tensor_parallel


def kv_cache_insertion(options) -> Pass:
    """The pass turning the stateless forward into the stateful one with static KV buffers."""

    def insert(graph: Graph) -> Graph:
        from .insert_kv_cache import insert_kv_cache, paged_layout  # imported when run: a sibling file

        paged = None
        if getattr(options, "kv_layout", "static") == "paged":
            paged = paged_layout(options.max_batch, options.max_seq_len, options.kv_block_size, options.kv_blocks)
        return insert_kv_cache(
            graph,
            max_batch=options.max_batch,
            max_seq_len=options.max_seq_len,
            token_trees=bool(getattr(options, "token_trees", False)),
            kv_cache=getattr(options, "kv_cache", "f32"),
            paged=paged,
        )

    return Pass("insert_kv_cache", insert, preserves_signature=False)


def tensor_parallel_sharding(ranks: int, rank_weights: list) -> Pass:
    """The pass sharding the stateful graph over `ranks` (passes/shard_tensor_parallel.py). The
    graph is the same on every rank: the pass returns rank 0's, with its weights attached, and
    puts the weights of ranks 1..N-1 into `rank_weights` (the artifact saves them beside it)."""

    def shard(graph: Graph) -> Graph:
        shards = [shard_tensor_parallel(graph, rank, ranks) for rank in range(ranks)]
        rank_weights[:] = [s.weights for s in shards[1:]]
        return shards[0]

    return Pass("shard_tensor_parallel", shard, preserves_signature=False)


def fusion_passes() -> list[Pass]:
    """The `fuse` phase, in order. Each pass leaves no dead nodes, so the next one's matcher sees
    true use counts."""
    return [
        # Eager matmul/softmax/matmul -> attention; canonicalize cancels the k transposes it adds.
        Pass("fuse_attention_pattern", fuse_attention_pattern),
        Pass("canonicalize", canonicalize),
        Pass("dce", eliminate_dead_code),
        # Linears in one form: weight in [out, in], bias inside, no flatten around (GPT-2's Conv1D).
        Pass("fold_transposes", fold_transposes),
        Pass("fuse_bias_activation", fuse_bias_activation),
        Pass("fold_linear_reshapes", fold_linear_reshapes),
        Pass("fuse_rope", fuse_rope),
        # layer_norm before rms_norm: LayerNorm's variance is an RMS of the centered input.
        Pass("fuse_layer_norm", fuse_layer_norm),
        Pass("fuse_rms_norm", fuse_rms_norm),
        Pass("fold_norm_casts", fold_norm_casts),  # f16/bf16 models: the norm's f32 casts go inside it
        Pass("fuse_add_rms_norm", fuse_add_rms_norm),
        Pass("fuse_projections", fuse_projections),
        Pass("fuse_gathered_matmul", fuse_gathered_matmul),  # MoE experts applied in place
    ]


def default_pipeline(
    options,
    dump_dir: str | Path | None = None,
    progress: Callable[[PassRecord], None] | None = None,
    fuse: bool = True,
    calibration=None,
    rank_weights: list | None = None,
) -> PassManager:
    """The pipeline for `options` (any object with `max_batch` and `max_seq_len`, such as
    `kiln.backends.executable.BackendOptions` or `kiln.compile_options.CompileOptions`; its
    `quantize` names a weight scheme, its `tensor_parallel`, if above 1, the ranks to shard over).
    `fuse=False` leaves the fuse phase empty (for measuring what fusion does). `calibration`: token
    ids [sequences, length] for data-aware quantization schemes. `rank_weights`: the list the shard
    phase fills with the weights of ranks 1..N-1."""
    phases = [
        # Phase 1: one normal form for the pattern matchers: no no-ops, constants folded.
        (
            "canonicalize",
            [
                Pass("canonicalize", canonicalize),
                Pass("constant_fold", fold_constants),
                Pass("dce", eliminate_dead_code),
            ],
        ),
        # Phase 2: attention, linears, rope, norms, residual-add + norm, merged projections.
        ("fuse", fusion_passes() if fuse else []),
        # Phase 3: weight quantization when options.quantize names a scheme (passes/quant_schemes.py).
        ("quantize", quantization_passes(options, calibration)),
        # Phase 4: (tokens, positions) -> logits becomes (tokens, positions, caches) -> (logits, caches).
        ("kv_cache", [kv_cache_insertion(options)]),
        # Phase 5: sweep up what the rewrites left behind and merge what they duplicated.
        (
            "cleanup",
            [
                Pass("dce", eliminate_dead_code),
                Pass("cse", eliminate_common_subexpressions),
                Pass("dce", eliminate_dead_code),
            ],
        ),
    ]
    ranks = getattr(options, "tensor_parallel", 1)
    if ranks > 1:
        # Phase 6: every rank's share of the graph, Megatron style (one graph, per-rank weights).
        if rank_weights is None:
            raise ShardingError(
                "sharding over ranks needs a list for the weights of ranks 1..N-1. "
                "Fix: pass rank_weights=[] to the pipeline."
            )
        phases.append(("shard", [tensor_parallel_sharding(ranks, rank_weights)]))
    return PassManager(phases, dump_dir=dump_dir, progress=progress)


def run_pipeline(
    graph: Graph,
    options,
    dump_dir: str | Path | None = None,
    progress: Callable[[PassRecord], None] | None = None,
    fuse: bool = True,
    calibration=None,
    rank_weights: list | None = None,
) -> Graph:
    """Compile a captured graph with the default pipeline; returns the stateful, optimized graph
    (rank 0's when sharding: `rank_weights` gets the others')."""
    return default_pipeline(
        options, dump_dir=dump_dir, progress=progress, fuse=fuse, calibration=calibration, rank_weights=rank_weights
    ).run(graph)
