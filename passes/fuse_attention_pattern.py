"""fuse_attention_pattern: attention written as matmul / softmax / matmul -> `attention`.

Hugging Face's eager attention (GPT-2, BLOOM, MPT, Gemma 2, and any model loaded with
attn_implementation="eager") is captured as
    scores = reshape(matmul(reshape(q, [b*h, s, d]), reshape(k^T, [b*h, d, t])), [b, h, s, t])
    scores = scores * scale                 (or / c; absent: scale 1)
    scores = c * tanh(scores / c)           (softcap, optional)
    scores = scores + bias                  (ALiBi, optional: BLOOM, MPT)
    probs  = softmax(scores + mask, -1)     (or masked_fill(scores, hidden, -big); optional)
    out    = reshape(matmul(reshape(probs, [b*h, s, t]), reshape(v, [b*h, t, d])), [b, h, s, d])
(the reshapes are absent when the matmuls are 4-D; scales, bias and mask come in any order
outside the softcap, and a bias under a later scale is scaled with it). It becomes
    out = attention(q, k, v, mask) {scale, softcap, alibi, causal=false}
with q, k, v back in [b, h, s, d]: the flattening reshapes are undone and k^T is transposed
back by a `permute`, which canonicalize then cancels against the model's own (GQA's
repeat_kv reshape/expand is kept, and insert_kv_cache sees through it as for SDPA).
A float mask made as where(visible, 0, very negative) becomes the bool `visible` (what SDPA
capture gives), masked_fill's `hidden` becomes not(hidden); other masks are passed as they
are. An added term built from constants and sizes alone that grows linearly with the key index
is ALiBi (`alibi_bias.py`): its slopes become the `alibi` attribute. The scores and
probabilities must have no other reader (output_attentions), or nothing is fused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.ir import Graph, Node, Value

from .alibi_bias import alibi_slopes
from .dce import eliminate_dead_code
from .match import constant, has_shape, is_last_axis, made_by, sole_reader, split_operands

VERY_NEGATIVE = -1e30  # an additive mask entry at or below this hides the key


@dataclass
class ScoresChain:
    """What lies between the first matmul and the softmax, read from the softmax inward.

    `scale` is the product of the scales met so far: a term added further in is multiplied by
    it on the way out (an ALiBi bias under Falcon's `* inv_norm`)."""

    scale: float = 1.0
    softcap: float = 0.0
    mask: Value | None = None
    hidden: Value | None = None  # a bool mask of hidden keys (masked_fill), made visible at rewrite
    alibi: tuple = ()
    matmul: Node | None = None

    def add_mask(self, mask: Value | None = None, hidden: Value | None = None) -> bool:
        if self.mask is not None or self.hidden is not None or self.softcap:
            return False
        self.mask, self.hidden = mask, hidden
        return True

    def add_term(self, graph: Graph, term: Value, at: Value, scores_shape: tuple) -> bool:
        """An added mask (where(visible, 0, -big) or any float mask) or an ALiBi bias."""
        visible = _visible_of_additive(term)
        if visible is not None:
            return self.add_mask(mask=visible)
        slopes = None if self.softcap else alibi_slopes(graph, term, at, scores_shape)
        if slopes is not None:
            scaled = tuple(s * self.scale for s in slopes)
            self.alibi = tuple(a + b for a, b in zip(self.alibi, scaled)) if self.alibi else scaled
            return True
        return self.scale == 1.0 and self.add_mask(mask=term)


def _softcapped(value: Value) -> tuple[Value, float] | None:
    """(x, c) for value = c * tanh(x / c)."""
    outer = made_by(value, "mul")
    split = split_operands(outer, lambda v: made_by(v, "tanh") is not None) if outer else None
    cap = constant(split[1]) if split else None
    inner = made_by(made_by(split[0], "tanh").inputs[0], "div") if cap else None
    if inner is None or constant(inner.inputs[1]) != cap:
        return None
    return inner.inputs[0], float(cap)


def _is_scalar_constant(value: Value) -> bool:
    return value.type.rank == 0 and constant(value) is not None and not isinstance(constant(value), bool)


def _scaled(node: Node) -> tuple[Value, float] | None:
    """(x, factor) for x * c, c * x or x / c with a scalar constant c."""
    split = split_operands(node, _is_scalar_constant)
    if split is None or (node.op == "div" and split[0] is not node.inputs[1]):
        return None
    factor = float(constant(split[0]))
    return split[1], factor if node.op == "mul" else 1.0 / factor


def _hides(value: Value) -> bool:
    c = constant(value)
    return c is not None and not isinstance(c, bool) and c <= VERY_NEGATIVE


def _walk(graph: Graph, value: Value, chain: ScoresChain, scores_shape: tuple) -> ScoresChain | None:
    """Peel masks, ALiBi terms, scales, softcap and reshapes off `value` down to the q·kᵀ matmul."""
    while True:
        node = value.producer
        if node is None:
            return None
        if node.op == "matmul":
            chain.matmul = node
            return chain
        capped = _softcapped(value)
        if capped is not None and not chain.softcap:
            if chain.scale != 1.0:
                return None  # a scale outside the softcap: not attention's formula
            value, chain.softcap = capped
            continue
        if node.op == "reshape":
            value = node.inputs[0]
        elif node.op in ("mul", "div") and _scaled(node) is not None:
            value, factor = _scaled(node)
            chain.scale *= factor
        elif node.op == "where" and _hides(node.inputs[1]) and chain.add_mask(hidden=node.inputs[0]):
            value = node.inputs[2]  # masked_fill(scores, hidden, -big)
        elif node.op == "where" and _hides(node.inputs[2]) and chain.add_mask(mask=node.inputs[0]):
            value = node.inputs[1]
        elif node.op == "add":
            for term, rest in (node.inputs, node.inputs[::-1]):
                branch = replace(chain)
                if branch.add_term(graph, term, node.output, scores_shape):
                    found = _walk(graph, rest, branch, scores_shape)
                    if found is not None:
                        return found
            return None
        else:
            return None


def _scores_chain(graph: Graph, softmax: Node) -> ScoresChain | None:
    scores = softmax.inputs[0]
    return _walk(graph, scores, ScoresChain(), scores.type.shape)


def _only_path(start: Value, end: Node, graph: Graph) -> list[Node] | None:
    """The nodes from `start` to `end` if each value on the way has one reader (the next node)."""
    path, value = [], start
    while len(path) < 16:
        user = sole_reader(value, graph)
        if user is None or len(user.outputs) != 1:
            return None
        path.append(user)
        if user is end:
            return path
        value = user.output
    return None


def _probs_matmul(softmax: Node, graph: Graph) -> Node | None:
    """The matmul(probs, v) the softmax feeds as first operand (through a reshape or not)."""
    probs = softmax.output
    user = sole_reader(probs, graph)
    if user is not None and user.op == "reshape":
        probs, user = user.output, sole_reader(user.output, graph)
    return user if user is not None and user.op == "matmul" and user.inputs[0] is probs else None


def _fits(value: Value, shape: tuple) -> bool:
    """`value` is [b, h, rows, cols], or the same flattened to [b*h, rows, cols]."""
    b, h, rows, cols = shape
    return has_shape(value, shape) or has_shape(value, (b * h, rows, cols))


def _as_4d(graph: Graph, value: Value, shape: tuple, new_nodes: list[Node]) -> Value:
    """`value` in [b, h, rows, cols]: itself, what it was flattened from, or a new reshape."""
    if value.type.rank == 4:
        return value
    flatten = made_by(value, "reshape")
    if flatten is not None and has_shape(flatten.inputs[0], shape):
        return flatten.inputs[0]
    node = graph.create("reshape", [value], {"shape": shape})
    new_nodes.append(node)
    return node.output


def _visible_of_additive(mask: Value | None) -> Value | None:
    """The bool `visible` behind an additive mask where(visible, 0, very negative), else None."""
    where = made_by(mask, "where")
    if where is not None and constant(where.inputs[1]) == 0 and _hides(where.inputs[2]):
        return where.inputs[0]
    return None


def _visible_of_hidden(graph: Graph, hidden: Value, new_nodes: list[Node]) -> Value:
    """not(hidden); MPT's cast(where(visible, 0, very negative), bool) gives `visible` back."""
    cast = made_by(hidden, "cast")
    visible = _visible_of_additive(cast.inputs[0]) if cast is not None else None
    if visible is not None:
        return visible
    node = graph.create("logical_not", [hidden])
    new_nodes.append(node)
    return node.output


def _fuse_one(graph: Graph, softmax: Node) -> bool:
    scores = softmax.inputs[0]
    if scores.type.rank != 4 or not is_last_axis(softmax.attrs["axis"], 4):
        return False
    chain, second = _scores_chain(graph, softmax), _probs_matmul(softmax, graph)
    if chain is None or second is None or _only_path(chain.matmul.output, softmax, graph) is None:
        return False
    batch, heads, rows, keys = scores.type.shape
    (q, k_t), v = chain.matmul.inputs, second.inputs[1]
    head_dim, value_dim = q.type.shape[-1], v.type.shape[-1]
    shapes = {
        q: (batch, heads, rows, head_dim),
        k_t: (batch, heads, head_dim, keys),
        v: (batch, heads, keys, value_dim),
        chain.matmul.output: scores.type.shape,
        second.inputs[0]: scores.type.shape,
    }
    if not all(_fits(value, shape) for value, shape in shapes.items()):
        return False
    out_shape = (batch, heads, rows, value_dim)
    out_user = sole_reader(second.output, graph)
    last = (
        out_user
        if out_user is not None and out_user.op == "reshape" and has_shape(out_user.output, out_shape)
        else second
    )
    new_nodes: list[Node] = []
    q, k_t, v = (_as_4d(graph, value, shapes[value], new_nodes) for value in (q, k_t, v))
    k = graph.create("permute", [k_t], {"perm": (0, 1, 3, 2)})
    new_nodes.append(k)
    mask = chain.mask if chain.hidden is None else _visible_of_hidden(graph, chain.hidden, new_nodes)
    attention = graph.create(
        "attention",
        [q, k.output, v, mask, None],
        {"scale": chain.scale, "softcap": chain.softcap, "causal": False, "alibi": chain.alibi},
    )
    new_nodes.append(attention)
    result = attention.output
    if last is second and not has_shape(second.output, out_shape):
        flat = graph.create("reshape", [result], {"shape": second.output.type.shape})
        new_nodes.append(flat)
        result = flat.output
    graph.insert_before(last, *new_nodes)
    graph.replace_all_uses(last.output, result)
    return True


def fuse_attention_pattern(graph: Graph) -> Graph:
    """Rewrite each matmul/softmax/matmul attention into `attention`, in place; dead nodes are removed."""
    for softmax in [n for n in graph.nodes if n.op == "softmax"]:
        _fuse_one(graph, softmax)
    return eliminate_dead_code(graph)
