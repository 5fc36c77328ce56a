"""The stateful graph on a CUDA GPU: Triton kernels from Inductor, each decode step one CUDA graph.

An artifact compiled for CUDA carries the IR and its weights and no AOTInductor package: the
code Inductor generates for a GPU belongs to the torch build and the GPU it was made on, so it
is compiled where the artifact is loaded (Inductor's cache keeps it for the next load).

One FX module holds the weights and KV buffers on the device; two compiled forms run it:
- decode (one token per row): torch.compile under coordinate-descent tuning, which turns a
  one-row matmul into a reduction that Inductor fuses with what feeds it (an int8 weight's
  conversion included: gpt-fast's recipe). Per batch size, one CUDA graph captured over static
  token and position buffers and replayed each step: a step is one graph launch from the host,
  not one launch per kernel;
- calls of several tokens per row (prefill, verification): torch.compile with dynamic shapes,
  run as they come (attention through SDPA's memory-efficient kernel: cuda_lowerings.py). A
  third form computes the lm_head at the last position alone (`run(..., last_only=True)`).
Logits come back to the host in f32, as the runtime samples there.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._inductor import config as inductor_config

from kiln.backends.executable import BackendOptions
from kiln.ir import Graph
from kiln.ir.errors import OptionError
from kiln.ir.ops.quantized import linear_q_reference

from .cuda_decode_fusion import fuse_decode_attention, use_triton_gemv
from .cuda_gemv import decode_linear_form
from .cuda_lowerings import decode_attention_form, linear_int4_cuda, linear_int8_channels
from .env_switch import env_choice
from .executable import StatefulRunner, without_stack_traces
from .lower_to_fx import graph_to_fx

LINEAR_FORMS = (F.linear, linear_int4_cuda, linear_int8_channels, linear_q_reference)  # x is the first argument
TUNING_SWITCH = "KILN_CUDA_DECODE_TUNING"  # "1" (default) or "0": cuBLAS's GEMV for one-row matmuls


def decode_tuning() -> bool:
    """Whether decode compiles under coordinate-descent tuning (KILN_CUDA_DECODE_TUNING, to compare)."""
    return env_choice(TUNING_SWITCH, ("1", "0")) == "1"


def check_cuda(device: str) -> torch.device:
    """The torch device for `device`, which this process must be able to use."""
    if not torch.cuda.is_available():
        raise OptionError(
            f"this artifact runs on {device!r}, and torch here ({torch.__version__}) sees no CUDA "
            "device. Fix: load it on a machine with an NVIDIA GPU and a CUDA build of torch, or "
            "recompile it with device='cpu'."
        )
    return torch.device(device)


class DecodeGraph:
    """One shape of decode step (batch size, and the tree or block-table feeds a graph takes)
    captured as a CUDA graph over static input buffers.

    The host's share of a step is kept small (it was 0.1 ms of SmolLM2's 0.86 on an H200:
    bench/results/gpu-h200-profile.md): feeds go up from pinned staging buffers without a
    synchronizing copy each, the logits' cast to f32 is part of the graph, and they come back
    into a pinned buffer with one copy and one wait."""

    def __init__(self, step, caches: list[torch.Tensor], feeds: list[torch.Tensor], device: torch.device):
        # zeros (slot 0 of block or row 0) and all-visible trees: what warm-up steps write and read
        self.inputs = [
            torch.ones_like(f, device=device) if f.dtype == torch.bool else torch.zeros_like(f, device=device)
            for f in feeds
        ]
        self.staged = [torch.empty(f.shape, dtype=f.dtype, pin_memory=True) for f in feeds]
        batch = feeds[0].size(0)
        saved = [cache[:batch, :, :1].clone() for cache in caches]  # warm-up writes slot 0 of these
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles (the first time), then runs once as it will be captured
                step(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(*self.inputs)[0].float()
        self.host_logits = torch.empty(self.logits.shape, dtype=torch.float32, pin_memory=True)
        self.device = device
        for cache, kept in zip(caches, saved):
            cache[:batch, :, :1].copy_(kept)

    def run(self, feeds: list[torch.Tensor]) -> torch.Tensor:
        """The logits [batch, 1, vocab] of one step, f32 on the host (a tensor of their own)."""
        for staged, buffer, feed in zip(self.staged, self.inputs, feeds):
            staged.copy_(feed)  # the previous step's copies are done: run() waited for them
            buffer.copy_(staged, non_blocking=True)
        self.graph.replay()
        self.host_logits.copy_(self.logits, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        # numpy's copy: in the engine's loop torch's clone of SmolLM2's logits cost 60 us, numpy's 8
        return torch.from_numpy(self.host_logits.numpy().copy())


def shape_key(feeds) -> tuple:
    return tuple((tuple(f.shape), f.dtype) for f in feeds)


def last_position_module(module: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of `module` whose lm_head reads the last position alone ([batch, 1, vocab]
    logits), or None where the logits are not a linear form of the hidden states."""
    graph = copy.deepcopy(module.graph)
    output = next(n for n in graph.nodes if n.op == "output")
    node = output.args[0][0]
    while node.target not in LINEAR_FORMS:  # through casts and elementwise ops (softcap) on the logits
        if not node.args or not isinstance(node.args[0], fx.Node) or node.op not in ("call_method", "call_function"):
            return None
        node = node.args[0]
    with graph.inserting_before(node):
        last = graph.call_function(operator.getitem, (node.args[0], (slice(None), slice(-1, None))))
    node.update_arg(0, last)
    copy_module = fx.GraphModule(module, graph)
    copy_module.input_names, copy_module.output_names = module.input_names, module.output_names
    return copy_module


class CudaInductorExecutable(StatefulRunner):
    """A stateful graph compiled by Inductor for a CUDA device, decode replayed as CUDA graphs."""

    exact_width = None  # cuBLAS picks other kernels (other sums) for other row counts

    def __init__(self, graph: Graph, options: BackendOptions, weights=None):
        named_caches = self._init_state(graph, options)  # on the device (_check_device)
        self.module = graph_to_fx(graph, weights, state=named_caches, device=options.device).to(self.device)
        self.compile_count = 0
        decode_module = fx.GraphModule(self.module, copy.deepcopy(self.module.graph))  # its own code object
        if decode_attention_form() == "fused":
            fuse_decode_attention(decode_module)
        if decode_linear_form() == "triton":
            use_triton_gemv(decode_module)
        self._decode = torch.compile(decode_module, backend=self._inductor)
        self._prefill = torch.compile(self.module, backend=self._inductor, dynamic=True)
        last = last_position_module(self.module)
        self._prefill_last = None if last is None else torch.compile(last, backend=self._inductor, dynamic=True)
        self.selects_logits = self._prefill_last is not None
        self._graphs: dict[tuple, DecodeGraph] = {}  # by the shapes of a decode call's feeds

    def _check_device(self, options: BackendOptions) -> None:
        self.device = check_cuda(options.device)

    @property
    def captured_batches(self) -> list[int]:
        """The batch sizes whose decode step is a captured CUDA graph."""
        return sorted({key[0][0][0] for key in self._graphs})

    def _inductor(self, gm: fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.compile_count += 1
        return compile_fx(gm, example_inputs)

    def _decode_step(self, *feeds: torch.Tensor):
        with inductor_config.patch(coordinate_descent_tuning=decode_tuning()), without_stack_traces():
            return self._decode(*feeds)

    def _run_front(self, tokens: torch.Tensor, positions: torch.Tensor, *extra) -> torch.Tensor:
        if tokens.size(1) > 1:
            return self._run_compiled(self._prefill, tokens, positions, *extra)
        feeds = [tokens, positions, *extra]
        key = shape_key(feeds)
        if key not in self._graphs:
            with torch.no_grad():
                self._graphs[key] = DecodeGraph(self._decode_step, self.caches, feeds, self.device)
        return self._graphs[key].run(feeds)

    def _run_last(self, tokens: torch.Tensor, positions: torch.Tensor, *extra) -> torch.Tensor:
        return self._run_compiled(self._prefill_last, tokens, positions, *extra)

    def _run_compiled(self, compiled, tokens, positions, *extra) -> torch.Tensor:
        feeds = [t.to(self.device) for t in (tokens, positions, *extra)]
        with torch.no_grad(), without_stack_traces():
            return compiled(*feeds)[0].float().cpu()

    def save(self, directory) -> list[str]:
        """No backend files: a CUDA artifact is compiled where it is loaded (see the module doc)."""
        return []


class CompiledWhereLoaded:
    """What lowering for CUDA gives on a machine without a GPU: nothing to save beside the IR and
    weights, since the GPU the artifact is loaded on compiles it (see the module doc)."""

    def __init__(self, graph: Graph, options: BackendOptions):
        self.graph, self.options = graph, options

    def save(self, directory) -> list[str]:
        return []

    def run(self, *args, **kwargs):
        check_cuda(self.options.device)
        raise OptionError("load the artifact (kiln.load) to run it on the GPU")


def lower_for_cuda(graph: Graph, options: BackendOptions):
    """The CUDA executable, or where this machine has no GPU the artifact's placeholder."""
    if torch.cuda.is_available():
        return CudaInductorExecutable(graph, options)
    return CompiledWhereLoaded(graph, options)
