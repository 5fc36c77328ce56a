"""Each decoder layer of a lowered FX module as one region, and the layers that are alike.

A layer's weights and KV buffers carry its index in their names (`model.layers.3.mlp...`,
`cache.k.3`); the lowered module reads each through a get_attr node. A node's *depth* is the
deepest layer it depends on; layer N's region is every node of depth N that reads one of layer
N's tensors or feeds a node that does. So work on positions alone (rope rows, sizes) stays
outside every region, as does what follows a layer's last own read (the residual add after its
MLP, the final norm and the LM head). Two regions are alike when their nodes, their inputs'
kinds and their outputs match node for node: outline_layers.py compiles each kind once.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from dataclasses import dataclass, field

import torch.fx as fx

from kiln.ir.ops.paged_kv import paged_write_index

from . import composite_ops

_PER_WRITE_INDICES = {composite_ops.kv_write_index, paged_write_index}
_NUMBERED = re.compile(r"^(.*?)_(\d+)(?:_|$)")
_CACHE = re.compile(r"^state_cache_[a-z_]+?_(\d+)(?:_\d+)?$")  # a taken name gets a suffix


@dataclass
class Region:
    """One layer's nodes in graph order, what they read from outside, what is read from them."""

    layer: int
    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    signature: tuple = ()


def layer_owners(attributes: list[str]) -> dict[str, int]:
    """Module attribute -> layer index. Attributes are IR names with every non-word character
    made `_` (lower_to_fx.attribute_name): `param_model_layers_3_mlp_...`, `state_cache_k_3`.
    The layers' container is the numbered prefix (`param_model_layers`) the most weights share."""
    numbered = {attr: _NUMBERED.match(attr) for attr in attributes if not attr.startswith("state_")}
    prefixes = Counter(m.group(1) for m in numbered.values() if m)
    container = prefixes.most_common(1)[0][0] if prefixes else None
    owners = {attr: int(m.group(2)) for attr, m in numbered.items() if m and m.group(1) == container}
    for attr in attributes:
        cache = _CACHE.match(attr)
        if cache:
            owners[attr] = int(cache.group(1))
    return owners


def split_shared_indices(graph: fx.Graph) -> None:
    """Give every kv_write its own index node: built once per graph from the first layer's keys
    (for their sizes), it would make the first layer's region unlike the others."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _PER_WRITE_INDICES:
            continue
        for user in list(node.users)[1:]:
            with graph.inserting_before(user):
                copy = graph.call_function(node.target, (user.args[1], *node.args[1:]), dict(node.kwargs))
            user.replace_input_with(node, copy)


def find_regions(graph: fx.Graph, owners: dict[str, int]) -> list[Region]:
    """The layers' regions, in layer order (a layer without reads of its own tensors has none)."""
    order = {node: k for k, node in enumerate(graph.nodes)}
    depth: dict[fx.Node, int] = {}
    anchors: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            depth[node] = owners.get(node.target, -1)
            continue
        inputs = node.all_input_nodes
        depth[node] = max((depth[i] for i in inputs), default=-1)
        if node.op != "output" and any(owners.get(i.target) == depth[node] for i in inputs if i.op == "get_attr"):
            anchors.add(node)
    members: dict[int, list[fx.Node]] = {}
    member_of: dict[fx.Node, int] = {}
    for node in reversed(graph.nodes):
        layer = depth[node]
        if node.op in ("get_attr", "placeholder", "output") or layer < 0:
            continue
        if node in anchors or any(member_of.get(u) == layer for u in node.users):
            member_of[node] = layer
            members.setdefault(layer, []).append(node)
    for node in graph.nodes:  # a part of a member's tuple belongs with it (regions return tensors)
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in member_of:
            layer = member_of[node.args[0]]
            if node not in member_of and depth[node] == layer:
                member_of[node] = layer
                members[layer].append(node)
    return [_region(layer, sorted(members[layer], key=order.__getitem__)) for layer in sorted(members)]


def _region(layer: int, nodes: list[fx.Node]) -> Region:
    region = Region(layer, nodes)
    inside = set(nodes)
    for node in nodes:
        for i in node.all_input_nodes:
            if i not in inside and i not in region.inputs:
                region.inputs.append(i)
    region.outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    region.signature = _signature(region)
    return region


def _signature(region: Region) -> tuple:
    """What must match for two regions to share one compiled body: each node's op, target and
    arguments (region inputs by position), each input's kind, and which nodes are outputs."""
    local = {n: f"%in{k}" for k, n in enumerate(region.inputs)}
    local.update({n: f"%{k}" for k, n in enumerate(region.nodes)})
    body = tuple(
        (n.op, _target_name(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: local[a])))
        for n in region.nodes
    )
    return body, tuple(_input_kind(i) for i in region.inputs), tuple(local[n] for n in region.outputs)


def _target_name(target) -> str:
    return target if isinstance(target, str) else f"{getattr(target, '__module__', '')}.{target!r}"


def _input_kind(node: fx.Node) -> tuple:
    """A weight or buffer by its shape, dtype and strides, a graph input by name; a computed
    value (the residual stream, rope rows, a size) is alike wherever the bodies that read it are."""
    if node.op == "get_attr":
        tensor = attribute_of(node)
        return ("tensor", tuple(tensor.shape), str(tensor.dtype), tuple(tensor.stride()))
    if node.op == "placeholder":
        return ("input", node.target)
    return ("value",)


def attribute_of(node: fx.Node):
    """The tensor (or module) a get_attr node names in its graph's module."""
    obj = node.graph.owning_module
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj
