"""The contract between the compiler and the runtime: what a backend produces.

The stateful graph (after `insert_kv_cache`) has the signature

    inputs:  tokens i64[batch, seq], positions i64[batch, seq],
             cache.k.0, cache.v.0, cache.k.1, ...   each [max_batch, kv_heads, max_seq_len, head_dim]
    outputs: logits f32[batch, seq, vocab], then the updated caches in the order of the cache inputs

`batch` <= max_batch: a call reads and writes cache rows [first_row, first_row + batch) (by default
the first `batch` rows; a scheduler gives each request its own row, see cache_rows.py). Row b's tokens
sit at positions[b, :], which may differ per row; a query sees cache slots <= its own position.
A backend owns the cache buffers and updates them in place, so the runtime feeds only tokens and
positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class BackendOptions:
    """What every backend is told when lowering. `dtype` is the compute/weight dtype name;
    `quantize` a weight scheme (kiln.passes.quant_schemes) or None, `quantize_embeddings` whether
    it also covers the lm_head and token embedding."""

    max_batch: int = 1
    max_seq_len: int = 1024
    dtype: str = "f32"
    threads: int | None = None
    device: str = "cpu"
    quantize: str | None = None
    quantize_embeddings: bool = False


class Executable(Protocol):
    """A compiled stateful forward that owns its KV buffers."""

    options: BackendOptions

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Logits f32[batch, seq, vocab] for int64 tokens/positions [batch, seq]; writes the caches
        of rows [first_row, first_row + batch)."""

    # Optional (the ONNX Runtime executable; the engine asks with getattr, others need nothing):
    # - `logits_buffer(batch, seq)` returns a tensor that `run(..., out=buffer)` writes the logits
    #   into instead of allocating them (the engine reuses one per decode batch size);
    # - `selects_logits` True: `run(..., last_only=True)` returns [batch, 1, vocab], the last
    #   position's logits alone, and skips the lm_head elsewhere (the engine's prompt chunks);
    # - `copies_rows` False: `cache_views` cannot be had (KV buffers on a device torch cannot
    #   address), so the engine reuses a cached prefix only in the row that holds it.

    def cache_views(self) -> list[torch.Tensor]:
        """Zero-copy torch views of the KV buffers (for copying rows between requests)."""

    def reset(self) -> None:
        """Forget all cached keys and values (zero the buffers)."""

    def save(self, directory: Path) -> list[str]:
        """Write the backend's own files into `directory`; return their names (for the manifest)."""


def cache_inputs(graph) -> list:
    """The graph inputs that are KV buffers (all inputs after tokens and positions)."""
    return graph.inputs[2:]
