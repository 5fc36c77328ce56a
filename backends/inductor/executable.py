"""The stateful graph compiled just in time by torch.compile with Inductor.

`lower(graph, options)` lowers the IR to an FX module whose KV caches are registered buffers
(`kv_write` scatters into them in place, as in gpt-fast) and compiles it with `torch.compile`.

Recompiles: positions are data, so decoding never recompiles per position. Sizes are the only
guards: the first call with seq > 1 marks seq dynamic (within the graph's symbol bounds), so one
graph serves every prefill length; seq == 1 (decode) gets its own specialization, as does
batch == 1 when max batch > 2 makes batch dynamic too. Hence at most four compiles for the life
of an executable: {batch 1, batch dynamic} x {decode, prefill}. `compile_count` counts them:
the torch.compile backend is a wrapper that increments it, then calls Inductor's `compile_fx`.

`save` writes an AOTInductor package (see aoti_package.py); `load` runs that package without
tracing or compiling anything.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import sympy
import torch
import torch.fx.config
from torch._inductor.compile_fx import compile_fx

from kiln.backends.cache_rows import check_rows, checked_feeds, run_at_rows
from kiln.backends.executable import BackendOptions, Executable, cache_inputs, fed_inputs
from kiln.backends.paged_feeds import layout_feeds, paged_layout
from kiln.backends.token_trees import has_token_trees, refuse_trees, tree_feeds
from kiln.ir import Graph, evaluate, to_torch, verify
from kiln.ir.errors import OptionError
from kiln.ir.ops.collectives import check_world, tensor_parallel_size

from .attention_kernel import FEW_QUERIES
from .lower_to_fx import graph_to_fx


def apply_threads(options: BackendOptions) -> None:
    """Use options.threads intra-op threads; Inductor bakes the count into its kernels at compile."""
    if options.threads:
        torch.set_num_threads(options.threads)


@contextmanager
def without_stack_traces():
    """Trace without recording a Python stack trace per FX node: export and Inductor's tracing
    spent a third of their time (SmolLM2: 12 of 37 s of decompositions) formatting tracebacks
    that only Inductor's own debugging output reads. The IR's nodes keep their source lines."""
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):  # torch before 2.12 has no such switch
        yield
        return
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved


def allocate_caches(graph: Graph, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Zero KV buffers for the graph's cache inputs, by input name (symbols at their upper bound)."""
    bounds = {name: bound.max for name, bound in graph.symbols.items()}
    return {
        v.name: torch.zeros([evaluate(d, bounds) for d in v.type.shape], dtype=to_torch(v.type.dtype), device=device)
        for v in cache_inputs(graph)
    }


def dynamic_dims(graph: Graph) -> list[tuple[int, int, int, int]]:
    """(input index, axis, min, max) for each tokens/positions dim that is a bounded symbol."""
    dims = []
    for index, v in enumerate(fed_inputs(graph)):
        for axis, d in enumerate(v.type.shape):
            if isinstance(d, sympy.Symbol) and d.name in graph.symbols:
                bound = graph.symbols[d.name]
                dims.append((index, axis, bound.min, bound.max))
    return dims


class StatefulRunner(Executable):
    """What every inductor executable shares: the KV buffers and the checks on tokens/positions."""

    graph: Graph
    caches: list[torch.Tensor]
    exact_width = FEW_QUERIES  # wider calls attend through ATen's SDPA (attention_kernel.cpp)

    device = torch.device("cpu")  # where the KV buffers and weights live

    def _init_state(self, graph: Graph, options: BackendOptions) -> dict[str, torch.Tensor]:
        self._check_device(options)
        verify(graph)
        if tensor_parallel_size(graph) > 1:  # fail here, not inside a compiled collective
            check_world(tensor_parallel_size(graph))
        apply_threads(options)
        self.graph, self.options = graph, options
        self.token_trees = has_token_trees(graph)  # read once: run() asks every step
        self.paged = paged_layout(graph)
        named = allocate_caches(graph, self.device)
        self.hold_caches(list(named.values()), [c.shape for c in named.values()])
        return named

    def _check_device(self, options: BackendOptions) -> None:
        if options.device != "cpu":
            raise OptionError(
                f"this executable runs on the CPU, not {options.device!r}. Fix: device='cpu', or "
                "load the artifact with its CUDA device (kiln.load(path, device='cuda'))."
            )

    def check_feeds(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 tokens/positions of equal shape [batch, seq], batch and positions within the buffers."""
        # contiguous: compiled graphs also guard on strides
        return checked_feeds(tokens, positions, self.max_batch, self.max_seq_len)

    def reset(self) -> None:
        """Forget all cached keys and values (zero the buffers in place)."""
        for cache in self.caches:
            cache.zero_()

    def cache_views(self) -> list[torch.Tensor]:
        return self.caches

    def run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        first_row: int = 0,
        *,
        last_only: bool = False,
        slots=None,
        tree=None,
        block_table=None,
    ) -> torch.Tensor:
        """Logits f32[batch, seq, vocab]; writes the tokens' keys/values into cache rows
        [first_row, first_row + batch) (the compiled step addresses rows from 0: others are swapped in).
        `last_only`: [batch, 1, vocab] of the last position where the executable `selects_logits`.
        `slots`/`tree`: see kiln.backends.token_trees; `block_table` (a paged cache, whose blocks
        replace rows): kiln.backends.paged_feeds."""
        feeds = self.check_feeds(tokens, positions)
        table = layout_feeds(self.paged, tokens.size(0), first_row, block_table)
        check_rows(first_row, tokens.size(0), self.max_batch)
        extra = tree_feeds(feeds[1], slots, tree) if self.token_trees else refuse_trees(slots, tree)
        front = self._run_last if last_only and self.selects_logits else self._run_front
        return run_at_rows(front, self.caches, *feeds, first_row, (*table, *extra))

    def _run_front(self, tokens: torch.Tensor, positions: torch.Tensor, *tree_feeds) -> torch.Tensor:
        """The compiled step over cache rows [0, batch) (JIT or AOTInductor: each subclass its own)."""
        raise NotImplementedError

    def _run_last(self, tokens: torch.Tensor, positions: torch.Tensor, *tree_feeds) -> torch.Tensor:
        """The step with the last position's logits alone (a subclass that `selects_logits`)."""
        raise NotImplementedError


class InductorExecutable(StatefulRunner):
    """A stateful graph compiled by torch.compile (Inductor) that owns its KV buffers."""

    def __init__(self, graph: Graph, options: BackendOptions, weights=None, freezing: bool = True):
        """`freezing` lets Inductor treat weights as constants (oneDNN prepacks linears); the
        caches stay buffers since they are mutated."""
        named_caches = self._init_state(graph, options)
        self.module = graph_to_fx(graph, weights, state=named_caches)
        self.compile_count = 0
        # Frozen, a 0-dim weight becomes a literal in the generated code, which Inductor's FX graph
        # cache keys by shape only: a rank's own such weight would reach another rank from the cache.
        self.freezing = freezing and tensor_parallel_size(graph) == 1
        self._dynamic_dims = dynamic_dims(graph)
        self._compiled_shapes: set[tuple[int, ...]] = set()
        self._compiled = torch.compile(self.module, backend=self._compile_with_inductor)

    def _compile_with_inductor(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        """The torch.compile backend: counts each compile (first call and every recompile)."""
        self.compile_count += 1
        return compile_fx(gm, example_inputs)

    def _mark_dynamic(self, feeds: tuple[torch.Tensor, ...]) -> None:
        # Sizes 0/1 always specialize, and a symbol whose range is {1, 2} is not worth a dynamic graph.
        for index, axis, low, high in self._dynamic_dims:
            if feeds[index].size(axis) > 1 and high > 2:
                torch._dynamo.mark_dynamic(feeds[index], axis, min=max(low, 2), max=high)

    def _run_front(self, tokens: torch.Tensor, positions: torch.Tensor, *tree_feeds) -> torch.Tensor:
        feeds = (tokens, positions, *tree_feeds)
        self._mark_dynamic(feeds)
        shape_class = tuple(min(size, 2) for size in feeds[0].shape)  # what the compiled graphs guard on
        with torch.no_grad():
            if shape_class in self._compiled_shapes:
                return self._compiled(*feeds)[0]
            # Dynamo reads `freezing` while tracing (weights become graph constants), so it must be
            # set around the call that compiles, not only in compile_fx; other calls skip the patch.
            with torch._inductor.config.patch(freezing=self.freezing), without_stack_traces():
                logits = self._compiled(*feeds)[0]
            self._compiled_shapes.add(shape_class)
            return logits

    def save(self, directory: Path) -> list[str]:
        """Write an AOTInductor package of this graph (no weights inside); returns its file names.
        A tensor-parallel graph gets none: it is compiled just in time when loaded (see __init__)."""
        from .aoti_package import write_package

        if tensor_parallel_size(self.graph) > 1:
            return []
        return write_package(self.graph, self.module, self.options, Path(directory))


def lower(graph: Graph, options: BackendOptions) -> InductorExecutable:
    """Compile a stateful graph (weights attached as graph.weights) with Inductor."""
    return InductorExecutable(graph, options)
