"""Compile each distinct decoder layer once: layers as calls of one shared FX subgraph.

`outline_layers(module)` rewrites the lowered module so that every layer region (layer_regions.py)
becomes `torch.ops.higher_order.invoke_subgraph(body, kind, *inputs)`, one body per kind of layer
(SmolLM2: the first layer, whose norm has no residual to add, and one body for the other 29;
Gemma 3 adds its sliding/full attention kinds), with that layer's weights and KV buffers among
its inputs; the body writes the buffers in place. Outside the bodies stay the embedding, work on
positions alone (rope rows), the final norm and the LM head.

What torch 2.13 needs for AOTInductor to compile a body once (`inline_subgraph_calls`):
- a tracing context around `aoti_compile_and_package`: its AOTAutograd runs without one, and
  without one the invoke_subgraph cache is off: every call traced and lowered on its own;
- C++ wrapper code for invoke_subgraph (it raises NotImplementedError): each call's block spells
  out the body's kernel calls as the conditional's code does, the kernels defined and built once.
  The body is scheduled anew for each call, so the bookkeeping its first scheduling left in its
  graph, the wrapper's record of allocated buffers and the size arrays declared inside an
  earlier block are reset first.
So export traces each body once and AOTAutograd and lowering run once per body; scheduling and
the wrapper's C++ (its g++ time) still grow with the number of layers.

When the regions cannot be outlined (no numbered layers, a region read by another before it
ends), the module is returned unchanged: the full graph is compiled as before.
"""

from __future__ import annotations

import copy
import operator
from contextlib import contextmanager

import torch
import torch.fx as fx
from torch._inductor.codegen.wrapper import EnterSubgraphLine, ExitSubgraphLine, WrapperLine
from torch.utils._ordered_set import OrderedSet

from kiln.ir.errors import KilnError

from .layer_regions import Region, find_regions, layer_owners, split_shared_indices


def outline_layers(module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """(the module with its layers as subgraph calls, the number of distinct layer bodies);
    (module, 0) when it has no layers to outline."""
    graph = _copy_graph(module.graph)
    holder = fx.GraphModule(module, graph)  # the same parameters and buffers, a graph of its own
    split_shared_indices(holder.graph)
    attributes = [n.target for n in holder.graph.nodes if n.op == "get_attr"]
    regions = find_regions(holder.graph, layer_owners(attributes))
    if len(regions) < 2:
        return module, 0
    bodies: dict[tuple, str] = {}
    for region in regions:
        if region.signature not in bodies:
            name = f"kiln_layer_{len(bodies)}"
            holder.add_submodule(name, _body(region))
            bodies[region.signature] = name
    try:
        outlined = _rebuild(holder, regions, bodies)
    except _NotConvex:
        return module, 0
    outlined.input_names, outlined.output_names = module.input_names, module.output_names
    return outlined, len(bodies)


class _NotConvex(KilnError):
    """A node outside a region both reads it and is read by it: the region cannot be one call
    (caught here: the full graph is compiled instead)."""


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    duplicate = fx.Graph()
    duplicate.output(duplicate.graph_copy(graph, {}))
    return duplicate


def _body(region: Region) -> fx.GraphModule:
    """The region as a module of its own: its inputs as placeholders, its outputs as a tuple."""
    body = fx.Graph()
    env = {node: body.placeholder(f"in{k}") for k, node in enumerate(region.inputs)}
    for node in region.nodes:
        env[node] = body.node_copy(node, lambda n: env[n])
    body.output(tuple(env[n] for n in region.outputs))
    return fx.GraphModule(torch.nn.Module(), body, class_name="KilnLayer")


def _rebuild(holder: fx.GraphModule, regions: list[Region], bodies: dict[tuple, str]) -> fx.GraphModule:
    """The top graph with each region replaced by one call at the place of its last node."""
    region_of = {node: region for region in regions for node in region.nodes}
    top = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    body_attrs: dict[str, fx.Node] = {}

    def mapped(n: fx.Node) -> fx.Node:
        if n not in env:
            raise _NotConvex(n.name)
        return env[n]

    for node in holder.graph.nodes:
        if node.op != "placeholder" and not body_attrs:  # the bodies' get_attrs after the inputs
            body_attrs.update({name: top.get_attr(name) for name in dict.fromkeys(bodies.values())})
        region = region_of.get(node)
        if region is None:
            env[node] = top.node_copy(node, mapped)
            continue
        if node is not region.nodes[-1]:
            continue
        name = bodies[region.signature]
        call = top.call_function(
            torch.ops.higher_order.invoke_subgraph,
            (body_attrs[name], name, *(mapped(i) for i in region.inputs)),
        )
        for k, out in enumerate(region.outputs):
            env[out] = top.call_function(operator.getitem, (call, k))
    return fx.GraphModule(holder, top, class_name="KilnFxModule")


@contextmanager
def inline_subgraph_calls():
    """Give torch's C++ wrapper (AOTInductor) code for invoke_subgraph while the block runs."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    def codegen_invoke_subgraph(self, invoke_subgraph):
        outer_inputs = [buf.codegen_reference() for buf in invoke_subgraph.inputs]
        outer_outputs = []
        for out in invoke_subgraph.outputs:
            self.writeline(f"RAIIAtenTensorHandle {out.get_name()};")
            outer_outputs.append(out.get_name())
        opening = _BlockStart(self)
        self.writeline(opening)
        self.writeline(EnterSubgraphLine(self, invoke_subgraph.subgraph.graph))
        _fresh_for_codegen(invoke_subgraph.subgraph.graph)
        prefix = f"{invoke_subgraph.subgraph.name}_"  # the body's buffers, allocated anew per call
        self.allocated = OrderedSet(n for n in self.allocated if not n.startswith(prefix))
        self.freed = OrderedSet(n for n in self.freed if not n.startswith(prefix))
        declared = dict(self.codegen_int_array_var_cache)  # as _BlockStart says, for arrays declared now
        self.codegen_subgraph(invoke_subgraph.subgraph, outer_inputs, outer_outputs)
        self.codegen_int_array_var_cache = declared
        self.writeline(ExitSubgraphLine(self))
        self.writeline(_BlockEnd(self, opening))

    saved = CppWrapperCpu.codegen_invoke_subgraph
    CppWrapperCpu.codegen_invoke_subgraph = codegen_invoke_subgraph
    try:
        # AOTInductor's AOTAutograd traces without a tracing context, and without one the
        # invoke_subgraph cache is off: each call traced, lowered and scheduled on its own.
        with torch._guards.tracing(torch._guards.TracingContext(None)):
            yield
    finally:
        CppWrapperCpu.codegen_invoke_subgraph = saved


class _BlockStart(WrapperLine):
    """`{` of a call's block. The size/stride arrays a block declares (at their first use, when
    the wrapper's lines are written out) are out of scope after it: forgotten at its `}`."""

    def __init__(self, wrapper):
        self.wrapper, self.saved = wrapper, {}

    def codegen(self, code) -> None:
        self.saved = dict(self.wrapper.codegen_int_array_var_cache)
        code.writeline("{")


class _BlockEnd(WrapperLine):
    def __init__(self, wrapper, start: _BlockStart):
        self.wrapper, self.start = wrapper, start

    def codegen(self, code) -> None:
        self.wrapper.codegen_int_array_var_cache = self.start.saved
        code.writeline("}")


def _fresh_for_codegen(lowered) -> None:
    """Put a lowered body's bookkeeping back as it was before its first codegen: each codegen
    schedules it anew, and the scheduler records in the graph which buffers it removed or fused
    away, which the next call's code would otherwise lack."""
    saved = lowered.__dict__.get("_kiln_before_codegen")
    if saved is None:
        lowered._kiln_before_codegen = {
            k: copy.copy(v) for k, v in lowered.__dict__.items() if isinstance(v, (set, dict, list, OrderedSet))
        }
        return
    for k, v in saved.items():
        setattr(lowered, k, copy.copy(v))
