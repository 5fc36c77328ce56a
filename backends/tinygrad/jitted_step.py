"""One jitted step (decode or prefill, for one batch size) with its own input and output buffers.

The tokens, positions and logits live in realized tinygrad buffers made once; each call writes
the inputs into them and reads the logits out (host_io.py: zero-copy numpy views of their memory
on the CPU, staged copies on a GPU). A
step fed fresh `Tensor(numpy)` inputs would pay tinygrad's scheduler for two copies per call:
~10 ms of Python on a decode step of a few milliseconds (profiled on a tiny GPT-2).

A prefill step's buffers hold `chunk` tokens; the traced function slices the first `seq` of
them, `seq` a bound Variable, so every length up to `chunk` replays the same kernels. A token-tree
step (`tree=True`) is a prefill step with two more buffers, the slots and the tree. A step with a
`last_var` returns one position's logits, [batch, 1, vocab], at the bound index, which forward
gets: the lm_head runs for that position alone. An `at_zero` step serves calls whose rows all start at position 0
(a prompt's first chunk): its starts are the constant 0, not Variables, so attention over the
chunk's own keys has fixed shapes (cache_attention.chunk_attention).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
from tinygrad import Context, Tensor, TinyJit, UOp, dtypes

from .host_io import HostIO
from .prefetch_loads import prefetching, streams_weights


class JittedStep:
    """`forward(tokens, positions, starts, slots, tree) -> logits` under a TinyJit, over buffers
    this step owns (slots and tree only for a token-tree step: a plain step passes None)."""

    def __init__(
        self,
        forward: Callable,
        state: list[Tensor],
        batch: int,
        length: int,
        vocab: int,
        logits_dtype,
        seq_var: UOp | None = None,
        beam: int = 0,
        tree: bool = False,
        last_var: UOp | None = None,
        at_zero: bool = False,
    ):
        """`length` tokens per row (1 for decode); `seq_var` makes the used length symbolic (prefill);
        `tree` adds slots [batch, length] and tree [batch, length, length] inputs; `state` (the KV
        caches forward writes) is realized with the logits."""
        self.tokens = Tensor.zeros(batch, length, dtype=dtypes.int64).contiguous().realize()
        self.positions = Tensor.zeros(batch, length, dtype=dtypes.int64).contiguous().realize()
        self.tree_inputs = []
        if tree:
            slots = Tensor.zeros(batch, length, dtype=dtypes.int64).contiguous().realize()
            self.tree_inputs = [slots, Tensor.zeros(batch, length, length, dtype=dtypes.bool).contiguous().realize()]
        kept = 1 if last_var is not None else length
        self.logits = Tensor.zeros(batch, kept, vocab, dtype=logits_dtype).contiguous().realize()
        self.seq_var, self.beam, self.last_var, self.at_zero = seq_var, beam, last_var, at_zero
        self.prefetch = streams_weights(length)  # the kernels compiled on the first call prefetch
        logits_buffer, tree_count = self.logits, len(self.tree_inputs)

        def step(tokens: Tensor, positions: Tensor, *rest) -> Tensor:
            slots, tree = rest[:tree_count] if tree_count else (None, None)
            variables = rest[tree_count:]
            starts = [0] * batch if at_zero else list(variables[:batch])
            if seq_var is not None:  # the bound length, passed after the starts
                seq = variables[0 if at_zero else batch]
                tokens, positions = tokens[:, :seq], positions[:, :seq]
                if tree_count:
                    slots, tree = slots[:, :seq], tree[:, :seq, :seq]
            last = variables[-1] if last_var is not None else None  # the index, passed last
            logits = forward(tokens, positions, starts, slots, tree, last)
            logits_buffer[:, : logits.shape[1]].assign(logits.cast(logits_buffer.dtype))
            Tensor.realize(logits_buffer, *state)
            return logits_buffer

        self.jit = TinyJit(step)
        self._tokens, self._positions, self._logits = (HostIO(t) for t in (self.tokens, self.positions, self.logits))
        self._tree = [HostIO(t) for t in self.tree_inputs]
        # Capture on the first call: TinyJit's eager first call exists for state a function creates
        # lazily, and here every weight, cache and buffer is realized before; it would only trace
        # and schedule the whole graph one more time (tens of seconds for a 30-layer model).
        self.jit.cnt = 1

    def __call__(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        starts: list[UOp],
        slots: np.ndarray | None = None,
        tree: np.ndarray | None = None,
        last: int | None = None,
    ) -> np.ndarray:
        """Logits [batch, seq, vocab] (a copy) for int64 tokens/positions [batch, seq] (and, for a
        token-tree step, int64 slots [batch, seq] and bool tree [batch, seq, seq]); a `last_var`
        step: [batch, 1, vocab], those of token `last` (default: the last one fed)."""
        seq = tokens.shape[1]
        self._tokens.write(np.s_[:, :seq], tokens)
        self._positions.write(np.s_[:, :seq], positions)
        if self._tree:
            self._tree[0].write(np.s_[:, :seq], slots)
            self._tree[1].write(np.s_[:, :seq, :seq], tree)
        starts = [] if self.at_zero else list(starts)
        variables = [*starts, self.seq_var.bind(seq)] if self.seq_var is not None else starts
        if self.last_var is not None:
            variables.append(self.last_var.bind(seq - 1 if last is None else last))
        # kernels compile before the jit has captured them: only then do the render hooks matter
        compiling = prefetching(self.prefetch) if self.jit.captured is None else contextlib.nullcontext()
        # JIT_BATCH_SIZE=0: the capture makes the whole step one graph (tinygrad's batches of 32,
        # 64, 128, ... kernels made SmolLM2's decode five graph calls, each a trip through its
        # scheduler and a hand-off to the native threads: int4-g32 decode 165-192 tokens/s
        # against 127-173 on the Intel Xeon, three rounds each way)
        # (tinygrad compiles in this process already: toolchain.install_chosen_compiler)
        with Context(BEAM=self.beam, JIT_BATCH_SIZE=0), compiling:
            self.jit(self.tokens, self.positions, *self.tree_inputs, *variables)
        return self._logits.read(np.s_[:, : 1 if self.last_var is not None else seq])
