"""A stateless graph (fixed shapes, no KV buffers) compiled by Inductor into one callable.

For small graphs the runtime calls many times per step, such as the eagle heads' draft step
(runtime/eagle_step.py): `compile_fx` on the FX module of the graph, called directly rather than
through torch.compile, so a call pays no Dynamo guard checks (about 0.1 ms on the Xeon, a quarter
of the eagle step). The weights are frozen into the compiled code (Inductor's `freezing`).
Inputs must have the graph's shapes and be contiguous. Inductor's FX graph cache bypasses these
graphs (frozen or not), so each process compiles its own: about 3 s for SmolLM2's eagle step on
the quiet Xeon (the generated C++ is cached, its compiler not run again).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._inductor.compile_fx import compile_fx

from kiln.ir import Graph, to_torch

from .executable import without_stack_traces
from .lower_to_fx import graph_to_fx


def lower_stateless(graph: Graph) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The compiled graph: called with its inputs in order, returns its outputs as a tuple."""
    examples = [torch.zeros([int(d) for d in v.type.shape], dtype=to_torch(v.type.dtype)) for v in graph.inputs]
    with torch._inductor.config.patch(freezing=True), without_stack_traces(), torch.no_grad():
        compiled = compile_fx(graph_to_fx(graph), examples)

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return tuple(compiled(*inputs))

    return run
