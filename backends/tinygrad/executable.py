"""The stateful graph run by tinygrad: realized weights and KV buffers, one TinyJit per step kind.

- Weights become realized tinygrad Tensors once, stored the way tinygrad's CPU kernels read
  them fastest (weight_layouts.py); the KV caches are realized zero Tensors that `kv_write`
  updates in place.
- Each row's cache position is a symbolic `Variable` (`start0`, `start1`, ...) bound at every
  call, so the jitted step is traced once and replayed at every position.
- Decode (seq == 1) and prefill (seq > 1) are separate `TinyJit` functions per batch size.
  A prompt runs as fixed-length chunks (FIXED_CHUNKS, each compiled once, so products tile
  along the tokens), the rest in
  chunks of at most `prefill_chunk` tokens whose length is a bound Variable (`seq`); each
  chunk at its own start position (jitted_step.py). `last_only` steps return the last
  position's logits alone.
- A graph compiled with token trees (kiln.backends.token_trees) takes `slots` and `tree`: a call
  that feeds a real tree (not slots = positions under the lower triangle) runs a third kind of
  step, "tree", which feeds both and attends under the tree; every other call runs the plain
  steps above, which skip the tree, so decode costs what it costs without tree inputs.
Each step's TinyJit captures its kernels on the first call and replays them from then on:
nothing compiles after a step kind's first call (tested, counting tinygrad's compiled-program
cache). With KILN_TINYGRAD_BEAM=N (or tinygrad's BEAM=N) the decode
kernels are chosen by tinygrad's BEAM search, timed on this machine (minutes per model the first
time, then read from tinygrad's cache); prefill kernels keep the hand-coded optimizations.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import sympy
import torch
from tinygrad import Tensor, TinyJit, UOp, dtypes

from kiln.backends.cache_rows import LazyViews, check_rows, run_at_rows
from kiln.backends.errors import FeedError
from kiln.backends.executable import BackendOptions, Executable, cache_inputs
from kiln.backends.paged_feeds import refuse_paged
from kiln.backends.token_trees import has_token_trees, lower_triangle, refuse_trees, tree_feeds
from kiln.ir import Graph, evaluate, to_torch, verify

from .cpu_graph import install_cpu_graph
from .disk_cache import install_thread_connections
from .gpu_device import CompiledWhereLoaded, gpu_device_opens, on_gpu, open_gpu_device
from .graph_to_tensors import LoweringContext, graph_to_tensors
from .jitted_step import JittedStep
from .kernel_opts import install_kernel_opts
from .op_lowerings import check_lowering_table, tiny_dtype
from .prefetch_loads import install_prefetch_loads
from .toolchain import configure_cpu_device
from .weight_layouts import WeightLayouts, plan_weights, stored_weight
from .wide_loads import install_wide_loads

PREFILL_CHUNK = 64
FIXED_CHUNKS = (512, 128, 32)  # prompt pieces compiled at a fixed length, so products tile along tokens
# Pieces of a call at a symbolic start (a verification step, a prompt's later piece) compiled at a
# fixed length too: one pass over the weights serves their tokens (at a symbolic length, every
# token streamed the weights again). A shorter rest runs one of them padded (`_chunk_plan`). A
# prompt's first piece under 32 tokens stays symbolic, one step for every short prompt.
SHORT_CHUNKS = (16, 8)
PAD_F32_FROM = 4  # f32 weights: tokens from which a call's rest runs the shortest short chunk padded


def decode_beam() -> int:
    """The BEAM search width for decode kernels: KILN_TINYGRAD_BEAM, else tinygrad's own BEAM, else 0."""
    from tinygrad.helpers import BEAM

    return int(os.environ.get("KILN_TINYGRAD_BEAM", BEAM.value))


def to_tinygrad(tensor: torch.Tensor | np.ndarray) -> Tensor:
    """A realized tinygrad copy of a torch tensor (or numpy array) on the default device."""
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:  # numpy has no bf16: its bits go up as int16
            return Tensor(tensor.view(torch.int16).numpy()).bitcast(dtypes.bfloat16).contiguous().realize()
        tensor = tensor.numpy()
    return Tensor(tensor).realize()


WEIGHT_ALIGNMENT = 64  # wide_loads.py's vector types assume 16 bytes; a cache line keeps loads in one line


def weight_view(weight: torch.Tensor | np.ndarray, kept: list) -> Tensor:
    """A realized CPU tensor over the weight's own memory (appended to `kept`, which must outlive
    the tensor): copying SmolLM2's 538 MB into fresh tinygrad buffers took most of a load (page
    faults on new memory). A misaligned array (a tensor at an odd offset of the weights file) is
    first copied to aligned memory."""
    from tinygrad.dtype import _from_np_dtype

    array = weight.detach().cpu().contiguous().numpy() if isinstance(weight, torch.Tensor) else weight
    if not array.flags.c_contiguous or array.ctypes.data % WEIGHT_ALIGNMENT or array.size == 0:
        raw = np.empty(array.nbytes + WEIGHT_ALIGNMENT, np.uint8)
        start = -raw.ctypes.data % WEIGHT_ALIGNMENT
        aligned = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
        aligned[...] = array
        array = aligned
    kept.append(array)
    return Tensor.from_blob(array.ctypes.data, array.shape, dtype=_from_np_dtype(array.dtype))


def compiled_program_count() -> int:
    """How many kernels tinygrad has compiled in this process (its compiled-program cache)."""
    from tinygrad.codegen import to_program_cache

    return len(to_program_cache)


class TinygradExecutable(Executable):
    """A stateful graph lowered to tinygrad Tensors under TinyJit; owns its KV buffers."""

    def __init__(self, graph: Graph, options: BackendOptions, weights=None, prefill_chunk: int = PREFILL_CHUNK):
        self.on_gpu = on_gpu(options)
        if self.on_gpu:
            open_gpu_device(options.device)
        else:
            configure_cpu_device(options.device)
            install_cpu_graph(options.threads)
            install_thread_connections()
            install_kernel_opts()
            install_wide_loads()
            install_prefetch_loads()
        verify(graph)
        check_lowering_table()
        self.graph, self.options = graph, options
        weights = graph.weights if weights is None else weights
        self.layouts = WeightLayouts({}) if self.on_gpu else plan_weights(graph)
        self._held_memory: list[np.ndarray] = []
        place = to_tinygrad if self.on_gpu else functools.partial(weight_view, kept=self._held_memory)
        self.params = {name: place(stored_weight(name, weights[name], self.layouts)) for name in graph.params}
        bounds = {name: bound.max for name, bound in graph.symbols.items()}
        caches = {  # zeroed memory of our own, as the weights: realizing 60 zeros kernels took ~0.8 s of a load
            v.name: place(torch.zeros([evaluate(d, bounds) for d in v.type.shape], dtype=to_torch(v.type.dtype)))
            for v in cache_inputs(graph)
        }
        self.copies_rows = not self.on_gpu  # a GPU's caches are not host memory torch can view
        self.hold_caches(caches, [c.shape for c in caches.values()])
        self.prefill_chunk = max(2, min(prefill_chunk, self.max_seq_len))
        self._start_vars = [UOp.variable(f"start{b}", 0, self.max_seq_len - 1) for b in range(self.max_batch)]
        self._seq_var = UOp.variable("seq", 2, self.prefill_chunk)
        self._tree_seq_var = UOp.variable("tree_seq", 1, self.prefill_chunk)
        self.token_trees = has_token_trees(graph)
        self._batch_dim, self._seq_dim = graph.inputs[0].type.shape
        self.decode_beam = decode_beam()
        self.fixed_chunks = tuple(c for c in FIXED_CHUNKS if c <= self.max_seq_len)
        self.short_chunks = tuple(c for c in SHORT_CHUNKS if c <= self.max_seq_len)
        lengths = (*self.fixed_chunks, *self.short_chunks, self.prefill_chunk)
        self._last_var = {c: UOp.variable(f"last{c}", 0, c - 1) for c in lengths}
        # Tokens from which a call's rest runs the chunk of 8 padded: at a symbolic length, products
        # over packed codes dequantize them inside an untiled matmul (SmolLM2 int4-g32, EPYC: 2 tokens
        # 37.7 ms against the padded chunk's 26.4); f32 ones stream the weights once per token, which
        # costs less than the chunk below 4 tokens (26.6 ms for 2 against ~40).
        self.pad_from = 2 if any(s.packed for s in self.layouts.stored.values()) else PAD_F32_FROM
        self.steps: dict[tuple, JittedStep] = {}

    # -- the jitted steps ---------------------------------------------------------------
    def _forward(self, batch: int):
        """The graph on tinygrad Tensors for `batch` rows: what each step's TinyJit traces."""
        owned = frozenset(self.caches)

        def forward(tokens: Tensor, positions: Tensor, starts: list[UOp], slots=None, tree=None, last=None) -> Tensor:
            """The logits [batch, seq, vocab]; [batch, 1, vocab] at position `last` when given."""
            logits = self.graph.outputs[0]
            bindings = self._bindings(batch, tokens.shape[1])
            ctx = LoweringContext(bindings, starts, owned, self.layouts, last=last, logits=logits)
            feeds = {self.graph.inputs[0].name: tokens, self.graph.inputs[1].name: positions}
            if self.token_trees:  # a plain step: slots = positions, and no tree to apply (None)
                feeds |= {"slots": positions if slots is None else slots, "tree": tree}
            out = graph_to_tensors(self.graph, {**feeds, **self.caches, **self.params}, ctx)[0]
            return out[:, last : last + 1] if last is not None and not ctx.selected_last else out

        return forward

    def _bindings(self, batch: int, seq) -> dict:
        bindings = {}
        for dim, size in ((self._batch_dim, batch), (self._seq_dim, seq)):
            if isinstance(dim, sympy.Symbol):
                bindings[dim.name] = size
        return bindings

    def _step(
        self, batch: int, kind: str, length: int | None = None, last_only: bool = False, at_zero: bool = False
    ) -> JittedStep:
        """The step of `kind` ("decode", "prefill", "tree", or "fixed" of `length` tokens) for
        `batch` rows, made on first use; `last_only`: it returns one position's logits."""
        key = (batch, kind) + ((length,) if kind == "fixed" else ()) + (("last",) if last_only else ())
        key += ("at_zero",) if at_zero else ()
        if key not in self.steps:
            logits = self.graph.outputs[0].type
            decode, fixed = kind == "decode", kind == "fixed"
            length = 1 if decode else length if fixed else self.prefill_chunk
            self.steps[key] = JittedStep(
                self._forward(batch),
                list(self.caches.values()),
                batch,
                length,
                logits.shape[-1],
                tiny_dtype(logits.dtype),
                seq_var=None if decode or fixed else self._tree_seq_var if kind == "tree" else self._seq_var,
                beam=self.decode_beam if decode else 0,
                tree=kind == "tree",
                last_var=self._last_var[length] if last_only else None,
                at_zero=at_zero,
            )  # BEAM would time symbolic-length kernels at one length only
        return self.steps[key]

    @property
    def jits(self) -> dict[tuple, TinyJit]:
        """The TinyJit of each step made so far, by (batch, "decode" | "prefill" | "tree") or
        (batch, "fixed", length), with "last" appended for a step returning one position's logits."""
        return {key: step.jit for key, step in self.steps.items()}

    # -- running ------------------------------------------------------------------------
    selects_logits = True  # run(..., last_only=True): the lm_head runs for the last position alone

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        first_row: int = 0,
        out: torch.Tensor | None = None,
        last_only: bool = False,
        *,
        slots=None,
        tree=None,
    ) -> torch.Tensor:
        """Logits f32[batch, seq, vocab] for int64 tokens/positions [batch, seq] ([batch, 1, vocab],
        the last position's, with `last_only`); writes the caches of rows [first_row, first_row +
        batch) (the jitted steps address rows from 0: others are swapped in).
        `slots`/`tree`: see kiln.backends.token_trees. `out` is not used (logits_buffer is None)."""
        check_rows(first_row, tokens.size(0), self.max_batch)
        given = slots is not None or tree is not None
        extra = tree_feeds(positions, slots, tree) if self.token_trees and given else refuse_trees(slots, tree)
        # Made when first read (a swap of rows, a padded chunk). A GPU's rows are swapped whole, so
        # a padded chunk writes only its own row's later slots there: nothing to keep.
        views = [] if self.on_gpu else LazyViews(self.cache_views)
        front = functools.partial(self._run_front, last_only=last_only, views=views)
        swap = self._swap_whole_rows if self.on_gpu else None
        logits = run_at_rows(front, views, tokens, positions, first_row, extra, swap)
        return logits[:, -1:] if last_only and logits.shape[1] > 1 else logits

    def cache_views(self) -> list[torch.Tensor]:
        """The realized buffers' memory as torch tensors (zero-copy on the CPU device)."""
        if self.on_gpu:
            raise FeedError(
                "the KV rows of the tinygrad backend on a GPU are not host memory torch can view; "
                "prefix copies between rows need device='cpu' (the engine reuses a prefix in its own row)"
            )
        return [_torch_view(cache) for cache in self.caches.values()]

    def _swap_whole_rows(self, batch: int, first_row: int, used: int) -> None:
        """Rows [0, batch) and [first_row, first_row + batch) of every cache exchanged on the
        device, all slots: fixed shapes, so each (batch, first_row) compiles once."""
        caches = list(self.caches.values())
        fronts = [cache[:batch].contiguous() for cache in caches]
        rows = [cache[first_row : first_row + batch].contiguous() for cache in caches]
        Tensor.realize(*fronts, *rows)  # copies first, then each cache rewritten from them
        end = first_row + batch
        for cache, front, row in zip(caches, fronts, rows):
            pieces = [row, cache[batch:first_row], front, cache[end:]]
            cache.assign(Tensor.cat(*[p for p in pieces if p.shape[0]]).contiguous())
        Tensor.realize(*caches)

    def _run_front(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots=None, tree=None, last_only: bool = False, views=()
    ) -> torch.Tensor:
        if tree is not None and not _is_plain(positions, slots, tree):
            return self._run_tree(tokens, positions, slots, tree)
        tokens, starts = self._check_feeds(tokens, positions)
        pieces, begin = [], 0
        room = self.max_seq_len - int(starts.max())
        for used, length in self._chunk_plan(tokens.shape[1], at_zero=not starts.any(), room=room):
            chunk = tokens[:, begin : begin + used]
            if length is not None and used < length:
                pieces.append(self._run_padded(chunk, starts + begin, length, last_only, views))
            else:
                pieces.append(self._run_chunk(chunk, starts + begin, length, last_only))
            begin += used
        if last_only:
            return pieces[-1]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _chunk_plan(self, seq: int, at_zero: bool = False, room: int | None = None) -> list[tuple[int, int | None]]:
        """The call's pieces as (tokens used, fixed length or None for the symbolic-length step).

        Each piece is the longest fixed chunk that the tokens left fill (the short chunks too
        unless the call starts at position 0). At a symbolic start, `pad_from` to 15 tokens left
        that are not a short chunk run the shortest short chunk that holds them, padded
        (`_run_padded`: 4-7 tokens in the chunk of 8, 9-15 in the chunk of 16, which costs less
        than 8 and a padded 8), when its slots fit in the `room` the call has (max_seq_len - its
        largest start); otherwise what is left runs at a symbolic length (one token: the decode
        step), where every token streams the weights again."""
        short = () if at_zero else self.short_chunks
        chunks = self.fixed_chunks + short
        plan, begin = [], 0
        while begin < seq:
            left = seq - begin
            holding = [c for c in short if c > left >= self.pad_from and (room is None or begin + c <= room)]
            fitting = [c for c in chunks if c <= left]
            if holding and left not in chunks and left < max(short):
                plan.append((left, min(holding)))
            elif fitting:
                plan.append((fitting[0], fitting[0]))
            else:
                plan.append((min(left, self.prefill_chunk), None))
            begin += plan[-1][0]
        return plan

    def _run_chunk(
        self, tokens: np.ndarray, starts: np.ndarray, length: int | None, last_only: bool, last: int | None = None
    ) -> torch.Tensor:
        """One piece of `_chunk_plan`: `length` set, the fixed step of that many tokens (= seq);
        `last`: the token whose logits a `last_only` fixed step returns (default: the last)."""
        batch, seq = tokens.shape
        positions = starts[:, None] + np.arange(seq, dtype=np.int64)
        bound = [var.bind(int(s)) for var, s in zip(self._start_vars, starts)]
        if length is not None:
            at_zero = not starts.any()
            step = self._step(batch, "fixed", length, last_only, at_zero)
            return torch.from_numpy(step(tokens, positions, bound, last=seq - 1 if last is None else last))
        kind = "decode" if seq == 1 else "prefill"
        step = self._step(batch, kind, last_only=last_only and kind == "prefill")
        return torch.from_numpy(step(tokens, positions, bound))

    def _run_padded(
        self, tokens: np.ndarray, starts: np.ndarray, length: int, last_only: bool, views: list[torch.Tensor]
    ) -> torch.Tensor:
        """`used` < `length` tokens through the fixed step of `length`, the tail padded (the last
        token repeated at the next positions). The padding writes cache slots past the call's
        tokens, which hold other keys: the run_at_rows swap moves only the slots the call uses, so
        row 0's own keys sit there. They are copied out first and back after; the padding's
        logits are dropped. Causal masking keeps the padding from the real tokens' logits."""
        used = tokens.shape[1]
        padding = np.repeat(tokens[:, -1:], length - used, axis=1)
        rows = [(b, int(s) + used, int(s) + length) for b, s in enumerate(starts)]
        saved = [[view[b, :, begin:end].clone() for b, begin, end in rows] for view in views]
        try:
            logits = self._run_chunk(np.concatenate([tokens, padding], axis=1), starts, length, last_only, used - 1)
        finally:
            for view, kept in zip(views, saved):
                for (b, begin, end), slots in zip(rows, kept):
                    view[b, :, begin:end].copy_(slots)
        return logits if last_only else logits[:, :used]

    def _run_tree(self, tokens, positions, slots, tree) -> torch.Tensor:
        """A token tree: the tree step over chunks of at most prefill_chunk tokens, each at the
        slots its tokens write (a chunk sees every earlier chunk's tokens: checked)."""
        tokens, starts = self._check_feeds(tokens, slots, "slots")
        positions, tree = positions.to(torch.int64).numpy(), tree.numpy()
        _check_range(positions, self.max_seq_len, "positions")
        batch, seq = tokens.shape
        chunks = [(begin, min(begin + self.prefill_chunk, seq)) for begin in range(0, seq, self.prefill_chunk)]
        if not all(tree[:, begin:end, :begin].all() for begin, end in chunks):
            raise FeedError(
                f"a token tree of {seq} tokens hides tokens of an earlier chunk of {self.prefill_chunk} "
                "from a later one, which the tinygrad backend runs as separate steps. Fix: feed at most "
                f"{self.prefill_chunk} tokens per call when a tree hides any of them"
            )
        pieces = []
        for begin, end in chunks:
            bound = [var.bind(int(s) + begin) for var, s in zip(self._start_vars, starts)]
            step = self._step(batch, "tree")
            pieces.append(
                torch.from_numpy(
                    step(
                        tokens[:, begin:end],
                        positions[:, begin:end],
                        bound,
                        slots=starts[:, None] + np.arange(begin, end, dtype=np.int64),
                        tree=tree[:, begin:end, begin:end],
                    )
                )
            )
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _check_feeds(
        self, tokens: torch.Tensor, positions: torch.Tensor, name: str = "positions"
    ) -> tuple[np.ndarray, np.ndarray]:
        """int64 numpy tokens and each row's first slot (`positions`, or a tree's `slots`), after
        checking the contract."""
        if tokens.dim() != 2 or tokens.shape != positions.shape:
            raise FeedError(f"tokens {list(tokens.shape)} and {name} {list(positions.shape)} must both be [batch, seq]")
        batch, seq = tokens.shape
        if not 1 <= batch <= self.max_batch:
            raise FeedError(f"batch {batch} is outside [1, {self.max_batch}]; lower with a larger max_batch")
        positions = positions.to(torch.int64).numpy()
        starts = positions[:, 0].copy()
        if seq > 1 and not (np.diff(positions, axis=1) == 1).all():
            raise FeedError(
                f"the tinygrad backend needs each row's {name} consecutive (start, start+1, ...): "
                "its cache position is one symbolic start per row"
            )
        _check_range(positions, self.max_seq_len, name)
        return tokens.to(torch.int64).numpy(), starts

    def reset(self) -> None:
        """Forget all cached keys and values (zero the buffers in place)."""
        for cache in self.caches.values():
            cache.assign(Tensor.zeros(*cache.shape, dtype=cache.dtype).contiguous())
        Tensor.realize(*self.caches.values())

    def save(self, directory) -> list[str]:
        """Write tinygrad.json: what rebuilding the jitted steps from graph.kir and the weights needs."""
        from .artifact_files import write_backend_info

        return write_backend_info(directory, self)


def _check_range(values: np.ndarray, limit: int, name: str) -> None:
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= limit:
        raise FeedError(f"{name} must lie in [0, {limit}), got [{low}, {high}]")


def _is_plain(positions: torch.Tensor, slots: torch.Tensor, tree: torch.Tensor) -> bool:
    """Whether (slots, tree) are a plain call's: slots = positions under the lower triangle."""
    return torch.equal(slots, positions.to(slots.dtype)) and torch.equal(
        tree, lower_triangle(tree.shape[-1]).expand_as(tree)
    )


def _torch_view(tensor: Tensor) -> torch.Tensor:
    memory = tensor.uop.base.realized.as_memoryview(force_zero_copy=True)
    array = np.frombuffer(memory, dtype=tensor.dtype.fmt).reshape(tensor.shape)
    return torch.from_numpy(array)


def lower(graph: Graph, options: BackendOptions) -> TinygradExecutable | CompiledWhereLoaded:
    """Lower a stateful graph (weights attached as graph.weights) to tinygrad; for a GPU this
    machine's tinygrad cannot open, what the artifact keeps for the GPU to build from."""
    refuse_paged(graph, "tinygrad")
    if on_gpu(options) and not gpu_device_opens():
        return CompiledWhereLoaded(graph, options, PREFILL_CHUNK)
    return TinygradExecutable(graph, options)
