"""Capture one decoder layer per kind and repeat it in the IR, each copy with its layer's weights.

torch.export of a Hugging Face model costs about the same for every layer (SmolLM2-135M: 30
layers, ~9 s of a 2-core host's compile). Decoder layers whose modules match (same classes,
parameter shapes and settings such as a sliding window; `layer_idx` aside) trace to the same ops,
so the capture traces a model holding only *templates*: layer 0 (it reads the embeddings, not a
layer) and the first later layer of each kind (Gemma 3: sliding and full). The IR's nodes are
tagged with the layer their FX node ran in; every other layer is a copy of its kind's template,
reading the previous layer's output and its own weights. The graph equals a full capture's up to
value names.

The model is left as it was. Where the layers cannot be proven alike, or the captured program is
not a chain of layer blocks (work between layers in the model's loop, a layer reading another
layer's weights or anything but its predecessor's one output), the caller captures in full:
`plan_layers` and `repeat_layers` return the reason instead. `KILN_CAPTURE_LAYERS=full` forces it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from dataclasses import dataclass, field

import torch

from kiln.ir import Graph, Node, Value

SWITCH = "KILN_CAPTURE_LAYERS"  # "full": trace every layer
_PLAIN = (bool, int, float, str, type(None))


@dataclass
class LayerPlan:
    """Which layers the capture traces (`templates`, real indices in order) and, for every
    layer, the template it copies. `container` is the layers' path in the model."""

    container: str
    layers: torch.nn.ModuleList
    templates: list[int]
    template_of: list[int]
    tags: dict[int, int | None] = field(default_factory=dict)  # id(IR node) -> captured position

    def layer_of(self, fx_node) -> int | None:
        """The captured position of the layer an FX node ran in, from its module stack."""
        for path, _ in (fx_node.meta.get("nn_module_stack") or {}).values():
            match = re.fullmatch(rf"lm\.{re.escape(self.container)}\.(\d+)", path)
            if match:
                return int(match.group(1))
        return None

    def param_name(self, name: str) -> str:
        """A captured weight's name with the real layer index: the traced model's layer list
        holds the templates only, at positions 0, 1, ..."""
        match = re.fullmatch(rf"({re.escape(self.container)})\.(\d+)\.(.*)", name)
        if not match:
            return name
        return f"{match.group(1)}.{self.templates[int(match.group(2))]}.{match.group(3)}"

    def summary(self) -> str:
        kinds = len(set(self.template_of[1:]))
        return f"{len(self.templates)} of {len(self.template_of)} decoder layers traced (the first and {kinds} kind(s))"


def plan_layers(lm: torch.nn.Module) -> LayerPlan | str:
    """The templates to trace, or why every layer must be traced."""
    if os.environ.get(SWITCH, "once") == "full":
        return f"{SWITCH}=full"
    found = decoder_layers(lm)
    if found is None:
        return "no list of decoder layers found"
    container, layers = found
    signatures = [layer_signature(layer) for layer in layers]
    template_of = [0]
    for i in range(1, len(layers)):
        template_of.append(next(j for j in range(1, i + 1) if signatures[j] == signatures[i]))
    templates = sorted(set(template_of))
    if len(templates) == len(layers):
        return "no two decoder layers alike after the first"
    return LayerPlan(container, layers, templates, template_of)


def decoder_layers(lm: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(path, list) of the model's decoder layers: the ModuleList of num_hidden_layers modules."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    count = getattr(config, "num_hidden_layers", None)
    lists = [
        (name, module)
        for name, module in lm.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and name
    ]
    return lists[0] if len(lists) == 1 else None


def layer_signature(layer: torch.nn.Module) -> tuple:
    """What decides a layer's traced ops: its modules' classes and plain settings, its weights'
    names, shapes and dtypes. `layer_idx` is left out unless a setting names it (GPT-2's
    scale_attn_by_inverse_layer_idx makes it part of the math)."""
    parts = []
    for name, module in layer.named_modules():
        settings = {k: v for k, v in vars(module).items() if not k.startswith("_") and _is_plain(v)}
        if not any("layer_idx" in k and k != "layer_idx" and v for k, v in settings.items()):
            settings.pop("layer_idx", None)
        tensors = [
            (n, tuple(t.shape), t.dtype)
            for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        ]
        parts.append((name, type(module).__qualname__, tuple(sorted(settings.items(), key=str)), tuple(tensors)))
    return tuple(parts)


def _is_plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, _PLAIN)


@contextlib.contextmanager
def templates_only(lm: torch.nn.Module, plan: LayerPlan):
    """The model with only the template layers in its layer list (and its config saying so)."""
    owner_path, _, attribute = plan.container.rpartition(".")
    owner = lm.get_submodule(owner_path)
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    saved = {"num_hidden_layers": config.num_hidden_layers}
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        saved["layer_types"] = layer_types
    setattr(owner, attribute, torch.nn.ModuleList([plan.layers[i] for i in plan.templates]))
    try:
        config.num_hidden_layers = len(plan.templates)
        if layer_types is not None:
            config.layer_types = [layer_types[i] for i in plan.templates]
        yield
    finally:
        setattr(owner, attribute, plan.layers)
        for name, value in saved.items():
            setattr(config, name, value)


@dataclass
class _Block:
    """One captured layer's nodes, the predecessor's value it reads (None for the first) and the
    value it passes on."""

    nodes: list[Node]
    stream_in: Value | None = None
    stream_out: Value | None = None


def repeat_layers(graph: Graph, plan: LayerPlan, weights: dict[str, torch.Tensor]) -> Graph | str:
    """The graph of the captured templates made the graph of every layer, in place; or the reason
    it cannot be (the graph is then unchanged). `weights`: the model's tensors by IR name."""
    split = _split(graph, plan)
    if isinstance(split, str):
        return split
    preamble, blocks, postamble = split
    reason = _link(blocks, postamble, graph)
    if reason:
        return reason
    own = [_own_params(block, plan.container, plan.templates[p]) for p, block in enumerate(blocks)]
    if any(isinstance(o, str) for o in own):
        return next(o for o in own if isinstance(o, str))
    missing = [
        f"{plan.container}.{i}.{suffix}"
        for i, t in enumerate(plan.template_of)
        for suffix in own[plan.templates.index(t)]
        if f"{plan.container}.{i}.{suffix}" not in weights
    ]
    if missing:
        return f"weight {missing[0]} not found in the model"

    graph.nodes = []  # rewire freely: uses are recounted when the nodes go back in
    order, previous = list(preamble), None
    for i, t in enumerate(plan.template_of):
        position = plan.templates.index(t)
        block = blocks[position]
        if i == t:  # the template itself, read from its new predecessor
            _rewire(block.nodes, block.stream_in, previous)
            order += block.nodes
            previous = block.stream_out
        else:
            params = {
                value: graph.add_param(f"{plan.container}.{i}.{suffix}", weights[f"{plan.container}.{i}.{suffix}"])
                for suffix, value in own[position].items()
            }
            copies, previous = _copy(graph, block, {block.stream_in: previous, **params})
            order += copies
    _rewire(postamble, blocks[-1].stream_out, previous)
    graph.nodes = order + postamble
    _order_params(graph, plan)
    return graph


def _split(graph: Graph, plan: LayerPlan):
    """(preamble, blocks by captured position, postamble), or why the nodes are not in that form."""
    preamble, blocks, postamble = [], [_Block([]) for _ in plan.templates], []
    last = -1
    for node in graph.nodes:
        tag = plan.tags.get(id(node))
        if tag is None:
            (preamble if last < 0 else postamble).append(node)
            if last >= 0 and last != len(blocks) - 1:
                return f"{node.op} runs between decoder layers"
            continue
        if postamble or tag < last or tag > last + 1:
            return "the decoder layers' ops are not in layer order"
        blocks[tag].nodes.append(node)
        last = tag
    if last != len(blocks) - 1 or any(not b.nodes for b in blocks):
        return "a decoder layer has no ops"
    return preamble, blocks, postamble


def _link(blocks: list[_Block], postamble: list[Node], graph: Graph) -> str | None:
    """Each block reads only its own values, the preamble's and one value of the block before
    it (its `stream_out`, the next block's `stream_in`); the postamble, one of the last block's."""
    owner = {id(n): p for p, b in enumerate(blocks) for n in b.nodes}
    readers = [*((p, b.nodes) for p, b in enumerate(blocks)), (len(blocks), postamble)]
    for reader, nodes in readers:
        for node in nodes:
            for v in node.inputs:
                source = owner.get(id(v.producer)) if v is not None and v.producer is not None else None
                if source is None or source == reader:
                    continue
                if source != reader - 1:
                    return "a decoder layer's value is read past the next layer"
                if blocks[source].stream_out not in (None, v):
                    return "a decoder layer passes more than one value to the next"
                blocks[source].stream_out = v
    if any(b.stream_out is None for b in blocks):
        return "a decoder layer's result is not read"
    for before, block in itertools.pairwise(blocks):
        block.stream_in = before.stream_out
    if any(graph.is_output(v) for b in blocks for n in b.nodes for v in n.outputs):
        return "a graph output is computed inside a decoder layer"
    return None


def _own_params(block: _Block, container: str, index: int) -> dict[str, Value] | str:
    """The block's weights by name within its layer (`self_attn.q_proj.weight`)."""
    own, prefix = {}, f"{container}."
    for node in block.nodes:
        for v in node.inputs:
            if v is None or v.producer is not None or not v.name.startswith(prefix):
                continue
            layer, _, suffix = v.name[len(prefix) :].partition(".")
            if layer != str(index):
                return f"decoder layer {index} reads weight {v.name} of another layer"
            own[suffix] = v
    return own


def _rewire(nodes: list[Node], old: Value | None, new: Value | None) -> None:
    if old is None or old is new:
        return
    for node in nodes:
        node.inputs = [new if v is old else v for v in node.inputs]


def _copy(graph: Graph, block: _Block, mapping: dict) -> tuple[list[Node], Value]:
    """New nodes computing `block` with its inputs mapped; (the nodes, the copy's stream out)."""
    mapping = {id(k): v for k, v in mapping.items() if k is not None}
    copies = []
    for node in block.nodes:
        inputs = [mapping.get(id(v), v) if v is not None else None for v in node.inputs]
        copy = graph.make_node(node.op, inputs, dict(node.attrs), [v.type for v in node.outputs])
        for old, new in zip(node.outputs, copy.outputs):
            mapping[id(old)] = new
            line = graph.source_lines.get(old)
            if line is not None:
                graph.source_lines[new] = line
        copies.append(copy)
    return copies, mapping[id(block.stream_out)]


def _order_params(graph: Graph, plan: LayerPlan) -> None:
    """Parameters in a full capture's order: each run of the templates' weights (the layers'
    parameters, then their buffers) becomes the same run for every layer, layer by layer."""
    numbered = re.compile(rf"{re.escape(plan.container)}\.(\d+)\.(.*)")
    order, run = [], {}

    def flush():
        for i, t in enumerate(plan.template_of):
            order.extend(n for s in run.get(t, []) if (n := f"{plan.container}.{i}.{s}") in graph.params)
        run.clear()

    for name in graph.params:
        match = numbered.fullmatch(name)
        if match is None:
            flush()
            order.append(name)
        elif int(match.group(1)) in plan.templates:
            run.setdefault(int(match.group(1)), []).append(match.group(2))
    flush()
    graph.params = {n: graph.params[n] for n in order}
    graph.weights = {n: graph.weights[n] for n in order if n in graph.weights}
