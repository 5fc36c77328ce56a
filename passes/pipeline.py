"""The default compilation pipeline: one ordered list of passes, grouped in phases.

Read it top to bottom to know what the compiler does to a captured graph. With `dump_dir`,
the IR is written after each phase (`00-captured.kir`, `01-canonicalize.kir`, ...).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from kiln.ir import Graph

from .canonicalize import canonicalize
from .constant_fold import fold_constants
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .manager import Pass, PassManager, PassRecord


def kv_cache_insertion(options) -> Pass:
    """The pass turning the stateless forward into the stateful one with static KV buffers."""

    def insert(graph: Graph) -> Graph:
        from .insert_kv_cache import insert_kv_cache  # imported when run: a sibling file

        return insert_kv_cache(graph, max_batch=options.max_batch, max_seq_len=options.max_seq_len)

    return Pass("insert_kv_cache", insert, preserves_signature=False)


def default_pipeline(options, dump_dir: str | Path | None = None,
                     progress: Callable[[PassRecord], None] | None = None) -> PassManager:
    """The pipeline for `options` (any object with `max_batch` and `max_seq_len`, such as
    `kiln.backends.executable.BackendOptions`)."""
    phases = [
        # Phase 1: one normal form for the pattern matchers: no no-ops, constants folded.
        ("canonicalize", [
            Pass("canonicalize", canonicalize),
            Pass("constant_fold", fold_constants),
            Pass("dce", eliminate_dead_code),
        ]),
        # Phase 2: fusion passes go here (attention, q/k/v and gate/up projections, norms,
        # residual-add + norm, bias + activation).
        ("fuse", []),
        # Phase 3: weight quantization passes go here (schemes such as int8, int4-g128).
        ("quantize", []),
        # Phase 4: (tokens, positions) -> logits becomes (tokens, positions, caches) -> (logits, caches).
        ("kv_cache", [kv_cache_insertion(options)]),
        # Phase 5: sweep up what the rewrites left behind and merge what they duplicated.
        ("cleanup", [
            Pass("dce", eliminate_dead_code),
            Pass("cse", eliminate_common_subexpressions),
            Pass("dce", eliminate_dead_code),
        ]),
    ]
    return PassManager(phases, dump_dir=dump_dir, progress=progress)


def run_pipeline(graph: Graph, options, dump_dir: str | Path | None = None,
                 progress: Callable[[PassRecord], None] | None = None) -> Graph:
    """Compile a captured graph with the default pipeline; returns the stateful, optimized graph."""
    return default_pipeline(options, dump_dir=dump_dir, progress=progress).run(graph)
