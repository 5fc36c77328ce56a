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
- C++ wrapper code for invoke_subgraph (it raises NotImplementedError): each body becomes a C++
  lambda inside the wrapper's run_impl, written at the body's first call and called by the
  others, so the body is scheduled, its code generated and built by g++ once.
So export traces each body once, and AOTAutograd, lowering, scheduling and the wrapper's C++ run
once per body: what grows with the number of layers is one line per call.

When the regions cannot be outlined (no numbered layers, a region read by another before it
ends), the module is returned unchanged: the full graph is compiled as before.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager

import torch
import torch.fx as fx
from torch._inductor.codegen.wrapper import EnterSubgraphLine, ExitSubgraphLine, WrapperLine
from torch._inductor.ir import TensorBox

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
    """Give torch's C++ wrapper (AOTInductor) code for invoke_subgraph while the block runs: each
    body becomes one C++ lambda in the wrapper, defined at its first call, that later calls reuse."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    saved = CppWrapperCpu.codegen_invoke_subgraph
    CppWrapperCpu.codegen_invoke_subgraph = _codegen_invoke_subgraph
    try:
        # AOTInductor's AOTAutograd traces without a tracing context, and without one the
        # invoke_subgraph cache is off: each call traced, lowered and scheduled on its own.
        with torch._guards.tracing(torch._guards.TracingContext(None)):
            yield
    finally:
        CppWrapperCpu.codegen_invoke_subgraph = saved


def _codegen_invoke_subgraph(wrapper, invoke_subgraph) -> None:
    """`body(inputs..., outputs...);` for one call. At a body's first call its lambda is written
    there: the body scheduled and its code generated once, whatever the number of calls. The
    lambda captures the wrapper's locals (sizes, kernels, the proxy executor) by reference; it
    takes each tensor input as a borrowed handle (a temporary view made at the call lives until
    the call returns) and writes each output into the caller's handle."""
    subgraph = invoke_subgraph.subgraph
    function = f"{subgraph.name}_call"
    outer_outputs = []
    for out in invoke_subgraph.outputs:
        wrapper.writeline(f"RAIIAtenTensorHandle {out.get_name()};")
        outer_outputs.append(out.get_name())
    tensor_inputs = [isinstance(v, TensorBox) for v in subgraph.graph.graph_inputs.values()]
    defined = wrapper.__dict__.setdefault("_kiln_layer_functions", set())
    if function not in defined:
        defined.add(function)
        params = [f"{subgraph.name}_in{k}" for k in range(len(tensor_inputs))]
        results = [f"{subgraph.name}_out{k}" for k in range(len(outer_outputs))]
        signature = [f"AtenTensorHandle {p}" for p, t in zip(params, tensor_inputs) if t]
        signature += [f"RAIIAtenTensorHandle& {r}" for r in results]
        opening = _BlockStart(wrapper, f"auto {function} = [&]({', '.join(signature)}) {{")
        wrapper.writeline(opening)
        wrapper.writeline(EnterSubgraphLine(wrapper, subgraph.graph))
        declared = dict(wrapper.codegen_int_array_var_cache)  # as _BlockStart says, for arrays declared now
        wrapper.codegen_subgraph(subgraph, params, results)
        wrapper.codegen_int_array_var_cache = declared
        wrapper.writeline(ExitSubgraphLine(wrapper))
        wrapper.writeline(_BlockEnd(wrapper, opening, "};"))
    inputs = [buf.codegen_reference() for buf, t in zip(invoke_subgraph.inputs, tensor_inputs) if t]
    wrapper.writeline(f"{function}({', '.join(inputs + outer_outputs)});")


class _BlockStart(WrapperLine):
    """The opening line of a body's lambda. The size/stride arrays it declares (at their first
    use, when the wrapper's lines are written out) are out of scope after it: forgotten at its end."""

    def __init__(self, wrapper, line: str):
        self.wrapper, self.line, self.saved = wrapper, line, {}

    def codegen(self, code) -> None:
        self.saved = dict(self.wrapper.codegen_int_array_var_cache)
        code.writeline(self.line)


class _BlockEnd(WrapperLine):
    def __init__(self, wrapper, start: _BlockStart, line: str):
        self.wrapper, self.start, self.line = wrapper, start, line

    def codegen(self, code) -> None:
        self.wrapper.codegen_int_array_var_cache = self.start.saved
        code.writeline(self.line)
