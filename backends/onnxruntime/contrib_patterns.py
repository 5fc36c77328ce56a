"""Groups of IR nodes that ONNX Runtime runs faster as one com.microsoft kernel.

`plan_contrib_ops(graph)` finds the groups and returns a `Plan`: which nodes are not lowered on
their own (`skipped`: their outputs are produced by the group's kernel) and which node lowers
the whole group (`emitters`). Nodes of a group that other nodes still read are lowered as
usual; what nothing reads is pruned when the model is built.

- attention over kv_write(cache.k), kv_write(cache.v) -> GroupQueryAttention, reading q/k/v in
  the [batch, seq, heads*head_dim] layout the projections produce (packed as one input when
  they are slices of one fused projection), rope folded in (`do_rotary`) when both q and k go
  through a `rope` with the same tables, and the KV buffer bound as both past and present so
  the kernel writes the new keys/values in place. `seqlens_k` and `total_sequence_length`
  are inputs the executable computes from the positions, which must then be contiguous per row
  (it checks).
- add followed by rms_norm -> SkipSimplifiedLayerNormalization; add followed by layer_norm ->
  SkipLayerNormalization. Their sum output is the residual. Norms are matched as the fusion
  passes leave them (`rms_norm`, `add_rms_norm`, `layer_norm`): a graph compiled without the
  fuse phase keeps its norms in plain ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kiln.backends.token_trees import has_token_trees
from kiln.ir import Graph, Node, Value
from kiln.ir.dims import dims_equal

from .onnx_builder import MS_DOMAIN, NUMPY_DTYPES, OnnxBuilder, elem_type, shared_scope
from .op_lowerings import norm_scale, reshape_target, transposed_weight
from .plain_attention import tree_visible_keys
from .quantized_lowerings import lower_linear_q, matmul_nbits

Emitter = Callable[[OnnxBuilder], "str | list[str]"]


@dataclass
class Plan:
    """What the lowering driver does differently for contrib-op groups."""

    skipped: set[int] = field(default_factory=set)  # id(node): outputs defined by a group's kernel
    emitters: dict[int, Emitter] = field(default_factory=dict)  # id(node) -> lowers its group
    in_place_caches: set[str] = field(default_factory=set)  # cache inputs GroupQueryAttention updates
    packed_inputs: set[int] = field(default_factory=set)  # id(value) GroupQueryAttention reads whole

    def skip(self, node: Node) -> None:
        self.skipped.add(id(node))


def plan_contrib_ops(graph: Graph, attention_dtypes: frozenset[str] = frozenset({"f32", "f16"})) -> Plan:
    """Find every contrib-op group of `graph`; attention goes to GroupQueryAttention only in
    `attention_dtypes` (the provider's kernel types), else it stays in plain ONNX ops."""
    plan = Plan()
    outputs = {id(v) for v in graph.outputs}
    for node in graph.nodes:
        if node.op == "attention" and node.inputs[0].type.dtype in attention_dtypes:
            _plan_attention(graph, node, outputs, plan)
    absorbed: set[int] = set()
    for node in graph.nodes:
        _plan_norm(node, absorbed, plan)
    for node in graph.nodes:
        if node.op in ("linear", "linear_q"):
            _plan_split_projection(graph, node, outputs, plan)
    return plan


# -- attention -----------------------------------------------------------------------------
def _plan_attention(graph: Graph, node: Node, outputs, plan: Plan) -> None:
    q, k, v, mask, positions, tree, k_scales, _ = node.inputs
    writes = [k.producer, v.producer]
    if k_scales is not None:
        return  # an int8 cache: the plain lowering refuses it (op_lowerings.py)
    if mask is not None or positions is not _slots_input(graph) or any(w is None or w.op != "kv_write" for w in writes):
        return
    if tree is not None and tree is not graph.inputs[-1]:
        return
    if node.attrs["alibi"]:
        return  # GroupQueryAttention has no ALiBi: the plain lowering adds the bias
    caches = [w.inputs[0] for w in writes]
    if any(c not in graph.inputs[2:] or c.users != [w] for c, w in zip(caches, writes)):
        return
    if any(w.inputs[2] is not positions or w.output.users != [node] for w in writes):
        return
    q_heads, kv_heads, head_dim = q.type.shape[1], k.type.shape[1], q.type.shape[3]
    if not all(isinstance(d, int) for d in (q_heads, kv_heads, head_dim)) or head_dim % 8 or q_heads % kv_heads:
        return
    if q.type.dtype not in ("f32", "f16") or {k.type.dtype, v.type.dtype, writes[0].inputs[1].type.dtype} != {
        q.type.dtype
    }:
        return
    if v.type.shape[3] != head_dim:
        return
    max_seq_len = caches[0].type.shape[2]
    rotary = _foldable_rope(q, writes[0].inputs[1], graph.inputs[1], head_dim, max_seq_len)
    out_reshape = _bsh_reader(node.output, outputs)
    q_in, k_in = (rotary[0], rotary[1]) if rotary is not None else (q, writes[0].inputs[1])
    v_in = writes[1].inputs[1]
    sources = [_bsh_source(x) for x in (q_in, k_in, v_in)]
    packed = (
        _packed_source(sources, [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        if all(sources)
        else None
    )
    if packed is not None:
        plan.packed_inputs.add(id(packed))
    for w in writes:
        plan.skip(w)
    if out_reshape is not None:
        plan.skip(out_reshape)
    plan.in_place_caches.update(c.name for c in caches)
    inputs = (packed,) if packed is not None else (q_in, k_in, v_in)
    plan.emitters[id(node)] = lambda b: _emit_gqa(b, node, writes, inputs, rotary, out_reshape, graph.inputs[1])


def _slots_input(graph: Graph) -> Value:
    """Where keys and values are written and attended from: the `slots` input of a graph with
    token trees (kiln.backends.token_trees), else `positions`."""
    return graph.inputs[-2] if has_token_trees(graph) else graph.inputs[1]


def _foldable_rope(q: Value, k_new: Value, positions: Value, head_dim: int, max_seq_len) -> tuple | None:
    """(q before rope, k before rope, cos, sin) when both go through one `rope` GQA can do itself."""
    ropes = [q.producer, k_new.producer]
    if any(r is None or r.op != "rope" for r in ropes):
        return None
    if any(r.inputs[1] is not positions for r in ropes) or ropes[0].inputs[2:] != ropes[1].inputs[2:]:
        return None
    cos, sin = ropes[0].inputs[2:]
    rows, half = cos.type.shape
    if head_dim % 16 or not isinstance(half, int) or half % 8 or half > head_dim // 2:
        return None
    if not (isinstance(rows, int) and isinstance(max_seq_len, int) and rows >= max_seq_len):
        return None
    return ropes[0].inputs[0], ropes[1].inputs[0], cos, sin


def _bsh_source(value: Value) -> Value | None:
    """X for value = permute(reshape(X [b, s, h*d], [b, s, h, d]), [0, 2, 1, 3]), else None."""
    permute = value.producer
    if permute is None or permute.op != "permute" or tuple(p % 4 for p in permute.attrs["perm"]) != (0, 2, 1, 3):
        return None
    reshape = permute.inputs[0].producer
    if reshape is None or reshape.op != "reshape":
        return None
    source = reshape.inputs[0]
    b, s = value.type.shape[0], value.type.shape[2]
    if source.type.rank != 3 or not (dims_equal(source.type.shape[0], b) and dims_equal(source.type.shape[1], s)):
        return None
    return source


def _bsh_reader(out: Value, outputs) -> Node | None:
    """The reshape reading attention's output as [b, s, h*d] through permute(0, 2, 1, 3), if any."""
    readers = out.users
    if id(out) in outputs or len(readers) != 1 or readers[0].op != "permute":
        return None
    permute = readers[0]
    if tuple(p % 4 for p in permute.attrs["perm"]) != (0, 2, 1, 3):
        return None
    after = permute.output.users
    if id(permute.output) in outputs or len(after) != 1 or after[0].op != "reshape":
        return None
    return after[0]


def _bsh(b: OnnxBuilder, value: Value) -> str:
    """value [b, h, s, d] as [b, s, h*d]: its source when it was made that way, else transposed."""
    source = _bsh_source(value)
    if source is not None:
        return b.value(source)
    norm = value.producer
    if norm is not None and norm.op == "rms_norm" and _bsh_source(norm.inputs[0]) is not None:
        # a per-head norm (Gemma's q/k norm) normalizes the last axis: it commutes with the head
        # transpose, so it runs on [b, s, h, d] and no Transpose is needed
        heads, head_dim = value.type.shape[1], value.type.shape[3]
        split = b.op("Reshape", b.value(_bsh_source(norm.inputs[0])), b.const([0, 0, heads, head_dim]))
        scale = norm_scale(b, norm.inputs[1], norm.attrs["offset"], head_dim, value.type.dtype)
        normed = b.op("RMSNormalization", split, scale, axis=-1, epsilon=float(norm.attrs["eps"]))
        return b.op("Reshape", normed, b.const([0, 0, heads * head_dim]))
    return b.op("Reshape", b.op("Transpose", b.value(value), perm=[0, 2, 1, 3]), b.const([0, 0, -1]))


def _packed_source(sources: list[Value], widths: list[int]) -> Value | None:
    """T when q, k, v are the consecutive last-axis slices [0, wq), [wq, wq+wk), ... of T."""
    slices = [s.producer for s in sources]
    if any(n is None or n.op != "slice" for n in slices):
        return None
    whole = slices[0].inputs[0]
    start = 0
    for node, width in zip(slices, widths):
        axis, first, end, step = (node.attrs[k] for k in ("axis", "start", "end", "step"))
        if node.inputs[0] is not whole or axis % whole.type.rank != whole.type.rank - 1 or step != 1:
            return None
        if first != start or end != start + width:
            return None
        start += width
    return whole if whole.type.shape[-1] == start else None


# GroupQueryAttention's sequence lengths, graph inputs the executable fills from the positions it
# holds on the host: seqlens_k (i32 [batch]: each row's last position) and total_sequence_length
# (i32 scalar: the largest position + 1). Computed in the graph from `positions` instead, CUDA's
# kernel attends wrongly (ORT 1.31, H100: max error 2.9 against 7e-4 fed, the kernel alone).
SEQLENS_K, TOTAL_LENGTH = "seqlens_k", "total_sequence_length"


def _emit_gqa(
    b: OnnxBuilder, node: Node, writes: list[Node], inputs: tuple, rotary, out_reshape: Node | None, rope_positions
) -> str:
    """`inputs`: (packed qkv [b, s, (h + 2 kv) d],) or (q, k, v) each [b, h, s, d]. A token tree
    comes in as position_ids (RoPE's positions, apart from the slots the lengths give) and an
    attention_bias hiding the call's own slots the tree hides."""
    q, _, v_written, _, slots, tree = node.inputs[:6]
    q_heads, head_dim = q.type.shape[1], q.type.shape[3]
    kv_heads = v_written.type.shape[1]
    query, key, value = (b.value(inputs[0]), "", "") if len(inputs) == 1 else tuple(_bsh(b, x) for x in inputs)
    cos, sin = (b.value(rotary[2]), b.value(rotary[3])) if rotary is not None else ("", "")
    past = [b.value(w.inputs[0]) for w in writes]
    tree_inputs = []
    if tree is not None:
        position_ids = b.typed(rope_positions, "i64") if rotary is not None else ""
        tree_inputs = [position_ids, _tree_bias(b, slots, tree, q.type.dtype)]
    attrs = node.attrs
    out, _, _ = b.node(
        "GroupQueryAttention",
        [query, key, value, *past, SEQLENS_K, TOTAL_LENGTH, cos, sin, *tree_inputs],
        [None, b.value(writes[0].output), b.value(writes[1].output)],
        domain=MS_DOMAIN,
        label="attn",
        num_heads=q_heads,
        kv_num_heads=kv_heads,
        scale=float(attrs["scale"] if attrs["scale"] is not None else head_dim**-0.5),
        softcap=float(attrs["softcap"]),
        local_window_size=attrs["window"] if attrs["window"] else -1,
        do_rotary=int(rotary is not None),
        rotary_interleaved=0,
    )
    batch, _, seq, _ = q.type.shape
    b.declare(out, q.type.dtype, (batch, seq, q_heads * head_dim))
    for w in writes:
        b.declare(b.value(w.output), w.output.type.dtype, (batch, *w.output.type.shape[1:]))
    if out_reshape is not None:
        target = out_reshape.output.type.shape
        if tuple(target) == (batch, seq, q_heads * head_dim):
            b.rename(b.value(out_reshape.output), out)
        else:
            b.node(
                "Reshape",
                [out, reshape_target(b, (batch, seq, q_heads * head_dim), target)],
                [b.value(out_reshape.output)],
            )
    # attention's own output [b, h, s, d], for any other reader (pruned when there is none)
    return b.op("Transpose", b.op("Reshape", out, b.const([0, 0, q_heads, head_dim])), perm=[0, 2, 1, 3])


def _tree_bias(b: OnnxBuilder, slots: Value, tree: Value, dtype: str) -> str:
    """[b, 1, s, total_sequence_length]: 0 where a key is visible, -inf where it holds a token of
    this call the tree hides; one per graph, every layer adds the same."""
    key = f"tree_bias/{dtype}"
    if key not in b.memo:
        with shared_scope(b, "/model/tree"):
            keys = b.op("Cast", TOTAL_LENGTH, to=elem_type("i64"))
            visible = b.op("Unsqueeze", tree_visible_keys(b, slots, tree, keys), b.const([1]))
            numpy_dtype = NUMPY_DTYPES[dtype]
            b.memo[key] = b.op("Where", visible, b.const(0.0, numpy_dtype), b.const(-np.inf, numpy_dtype))
    return b.memo[key]


# -- normalizations ------------------------------------------------------------------------
def _plan_norm(node: Node, absorbed: set[int], plan: Plan) -> None:
    match = _match_norm(node)
    if match is None:
        return
    kind, x, weight, bias, eps, offset = match
    add = x.producer
    skip_add = (
        add is not None
        and add.op == "add"
        and id(add) not in absorbed
        and x.type.rank == 3
        and all(i.type.shape == x.type.shape and i.type.dtype == x.type.dtype for i in add.inputs)
    )
    if skip_add:
        absorbed.add(id(add))
        plan.skip(add)
    if not skip_add:
        return  # alone, a norm's plain lowering is RMSNormalization / LayerNormalization already
    plan.emitters[id(node)] = lambda b: _emit_norm(b, kind, x, weight, bias, eps, offset, add if skip_add else None)


def _match_norm(node: Node):
    """(kind, x, weight, bias, eps, offset) for rms_norm and layer_norm."""
    if node.op == "rms_norm":
        return "rms", node.inputs[0], node.inputs[1], None, node.attrs["eps"], node.attrs["offset"]
    if node.op == "layer_norm":
        return "layer", node.inputs[0], node.inputs[1], node.inputs[2], node.attrs["eps"], 0.0
    return None


def _emit_norm(b: OnnxBuilder, kind: str, x: Value, weight, bias, eps: float, offset: float, add: Node | None) -> str:
    scale = norm_scale(b, weight, offset, x.type.shape[-1], x.type.dtype)
    if add is None:
        return b.op("RMSNormalization", b.value(x), scale, axis=-1, epsilon=float(eps))
    op_type = "SkipSimplifiedLayerNormalization" if kind == "rms" else "SkipLayerNormalization"
    inputs = [b.value(add.inputs[0]), b.value(add.inputs[1]), scale] + ([b.value(bias)] if bias is not None else [])
    normed = b.node(op_type, inputs, [None, "", "", b.value(add.output)], domain=MS_DOMAIN, epsilon=float(eps))[0]
    b.declare(normed, x.type.dtype, x.type.shape)
    b.declare(b.value(add.output), x.type.dtype, x.type.shape)
    return normed


# -- projections -----------------------------------------------------------------------------
def _plan_split_projection(graph: Graph, node: Node, outputs, plan: Plan) -> None:
    """A fused projection (one linear, read only through last-axis slices) becomes one MatMul per
    slice over the matching rows of the weight: no slice copies, as separate projections run."""
    constants = [v for v in node.inputs[1:] if v is not None]  # weight (or q, scales, zeros) and bias
    readers = node.output.users
    if id(node.output) in outputs or id(node.output) in plan.packed_inputs:
        return
    if any(v.name not in graph.params for v in constants):
        return
    rank = node.output.type.rank
    if not readers or any(
        r.op != "slice"
        or r.attrs["axis"] % rank != rank - 1
        or r.attrs["step"] != 1
        or not isinstance(r.attrs["start"], int)
        or not isinstance(r.attrs["end"], int)
        or id(r) in plan.skipped
        for r in readers
    ):
        return
    for r in readers:
        plan.skip(r)
    plan.emitters[id(node)] = lambda b: _emit_split_projection(b, node, readers)


def _emit_split_projection(b: OnnxBuilder, node: Node, slices: list[Node]) -> str:
    quantized = node.op == "linear_q"
    x, weight, bias = node.inputs[0], node.inputs[1], node.inputs[-1]
    arrays = [None if v is None else b.weight(v) for v in node.inputs[1:-1]]  # weight, or q, scales, zeros
    bias_array = None if bias is None else b.weight(bias)
    whole = (lambda: lower_linear_q(b, node)) if quantized else (lambda: _whole_projection(b, x, weight, bias))
    if arrays[0] is None or (bias is not None and bias_array is None):  # weights not attached: keep it whole
        return whole()
    for part in slices:
        start, end = part.attrs["start"], min(part.attrs["end"], arrays[0].shape[0])
        label = f"{b.label}[{start}:{end}]" if b.label else None
        rows = [None if a is None else np.ascontiguousarray(a[start:end]) for a in arrays]
        part_bias = "" if bias is None else b.const(bias_array[start:end], bias_array.dtype)
        if quantized:
            out = matmul_nbits(b, b.value(x), *rows, part_bias, node.attrs, f"{weight.name}[{start}:{end}]")
            b.declare(out, part.output.type.dtype, part.output.type.shape)
        else:
            name = f"{weight.name}[{start}:{end}].T"
            if name not in b.initializers:
                b.initializer(name, np.ascontiguousarray(rows[0].T))
            out = b.op("MatMul", b.value(x), name, label=label)
            out = b.op("Add", out, part_bias, label=label) if part_bias else out
        b.rename(b.value(part.output), out)
    return whole()  # for any other reader (pruned when there is none)


def _whole_projection(b: OnnxBuilder, x: Value, weight: Value, bias: Value | None) -> str:
    y = b.op("MatMul", b.value(x), transposed_weight(b, weight))
    return b.op("Add", y, b.value(bias)) if bias is not None else y
