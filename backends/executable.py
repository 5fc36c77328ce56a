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

Each backend is a module satisfying `Backend` (NAME, backend_version, lower, load) whose
executables subclass `Executable`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class BackendOptions:
    """What every backend is told when lowering. `dtype` is the compute/weight dtype name;
    `quantize` a weight scheme (kiln.passes.quant_schemes) or None, `quantize_embeddings` whether
    it also covers the lm_head and token embedding; `kv_cache` what the KV buffers hold ("f32", or
    "int8": codes with a scale per token and head, see passes/insert_kv_cache.py); `kv_layout` how
    they are laid out ("static" rows, or "paged": `kv_blocks` blocks of `kv_block_size` slots
    addressed through a block table, None blocks meaning as many slots as the static rows)."""

    max_batch: int = 1
    max_seq_len: int = 1024
    dtype: str = "f32"
    threads: int | None = None
    device: str = "cpu"
    quantize: str | None = None
    quantize_embeddings: bool = False
    kv_cache: str = "f32"
    kv_layout: str = "static"
    kv_block_size: int = 32
    kv_blocks: int | None = None


class Executable:
    """Base of every backend's compiled stateful forward, which owns its KV buffers.

    It holds what every backend derives the same way: the options it was lowered with, the KV
    buffers (`caches`, in whatever form the backend runs them) and the limits they set,
    `max_batch` and `max_seq_len` (at most what the options asked). The optional capabilities
    a scheduler may use are declared here with their defaults; a backend that has one overrides it.
    """

    options: BackendOptions
    caches: object
    max_batch: int
    max_seq_len: int

    # Optional capabilities (the ONNX Runtime executable has them; see `capabilities`):
    selects_logits = False  # run(..., last_only=True) returns [batch, 1, vocab], the last position's
    #                         logits alone, and skips the lm_head elsewhere (the engine's prompt chunks)
    copies_rows = True  # False: cache_views cannot be had (KV buffers on a device torch cannot
    #                     address), so the engine reuses a cached prefix only in the row that holds it
    exact_width: int | None = None  # the most tokens a row's call may feed and still compute every
    #   position bit for bit as one-token calls do; speculative verification stays within it, so
    #   greedy output is plain decoding's even where int8-quantized activations turn a wider
    #   kernel's rounding into a different token (None: undeclared; verification is not cut, and
    #   prefix caching counts only one-token calls as exact: runtime/exact_reuse.py)

    def logits_buffer(self, batch: int, seq: int) -> torch.Tensor | None:
        """A tensor that `run(..., out=buffer)` writes [batch, seq, vocab] logits into instead of
        allocating them (the engine reuses one per decode batch size); None: run allocates."""
        return None

    def hold_caches(self, caches, shapes) -> None:
        """Keep the KV buffers and derive the limits from their shapes, each [max_batch, kv_heads,
        max_seq_len, head_dim] (a graph without caches keeps the options' limits)."""
        shapes = [tuple(shape) for shape in shapes]
        self.caches = caches
        if getattr(self.options, "kv_layout", "static") == "paged":  # pools of blocks: no rows to count
            self.max_batch, self.max_seq_len = self.options.max_batch, self.options.max_seq_len
            return
        self.max_batch = min([shape[0] for shape in shapes] + [self.options.max_batch])
        self.max_seq_len = min([shape[2] for shape in shapes] + [self.options.max_seq_len])

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Logits f32[batch, seq, vocab] for int64 tokens/positions [batch, seq]; writes the caches
        of rows [first_row, first_row + batch). A paged cache's executable takes `block_table=`
        instead of rows (backends/paged_feeds.py)."""
        raise NotImplementedError

    def cache_views(self) -> list[torch.Tensor]:
        """Zero-copy torch views of the KV buffers (for copying rows between requests)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget all cached keys and values (zero the buffers)."""
        raise NotImplementedError

    def save(self, directory: Path) -> list[str]:
        """Write the backend's own files into `directory`; return their names (for the manifest)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Capabilities:
    """The optional capabilities of an executable (declared on `Executable`), read once."""

    selects_logits: bool
    copies_rows: bool
    exact_width: int | None
    logits_buffer: Callable[[int, int], torch.Tensor | None]


def capabilities(executable) -> Capabilities:
    """What `executable` offers beyond `run`: an Executable declares every capability (with the
    base's defaults); a stand-in that only has `run` (a test's wrapper) gets the defaults for
    what it does not set."""
    return Capabilities(
        selects_logits=bool(getattr(executable, "selects_logits", Executable.selects_logits)),
        copies_rows=bool(getattr(executable, "copies_rows", Executable.copies_rows)),
        exact_width=getattr(executable, "exact_width", Executable.exact_width),
        logits_buffer=getattr(executable, "logits_buffer", None) or (lambda batch, seq: None),
    )


class Backend(Protocol):
    """What a backend module provides (kiln.backends.registry imports it by name)."""

    NAME: str

    def backend_version(self) -> str:
        """The version of what computes (its library, or torch)."""

    def lower(self, graph, options: BackendOptions) -> Executable:
        """An executable for a stateful graph with its weights attached."""

    def load(self, directory: Path, graph, weights: dict[str, torch.Tensor], options: BackendOptions) -> Executable:
        """The executable of an artifact: from its graph and weights, and the backend's own files."""


def fed_inputs(graph) -> list:
    """The graph inputs a caller feeds on every call: tokens, positions (and slots, tree)."""
    return [v for v in graph.inputs if not v.name.startswith("cache.")]


def cache_inputs(graph) -> list:
    """The graph inputs that are KV buffers (`cache.k.0`, ...: after tokens and positions, before
    the token-tree inputs of a graph that has them)."""
    return [v for v in graph.inputs[2:] if v.name.startswith("cache.")]
