"""fuse_attention_pattern: attention written as matmul / softmax / matmul -> `attention`.

Hugging Face's eager attention (GPT-2 and others with attn_implementation="eager") is captured as
    scores = reshape(matmul(reshape(q, [b*h, s, d]), reshape(k^T, [b*h, d, t])), [b, h, s, t])
    scores = scores * scale                 (or / c; absent: scale 1)
    scores = c * tanh(scores / c)           (softcap, optional)
    probs  = softmax(scores + mask, -1)     (mask optional)
    out    = reshape(matmul(reshape(probs, [b*h, s, t]), reshape(v, [b*h, t, d])), [b, h, s, d])
(the reshapes are absent when the matmuls are 4-D). It becomes
    out = attention(q, k, v, mask) {scale, softcap, causal=false}
with q, k, v back in [b, h, s, d]: the flattening reshapes are undone and k^T is transposed
back by a `permute`, which canonicalize then cancels against the model's own (GQA's
repeat_kv reshape/expand is kept, and insert_kv_cache sees through it as for SDPA).
A float mask made as where(visible, 0, very negative) becomes the bool `visible` (what SDPA
capture gives); other masks are passed as they are. The scores and probabilities must have
no other reader (output_attentions), or nothing is fused.
"""
from __future__ import annotations

from kiln.ir import Graph, Node, Value

from .dce import eliminate_dead_code
from .match import Users, constant, has_shape, is_last_axis, made_by, sole_user, split_operands
from .rewrite import insert_before, replace_value

VERY_NEGATIVE = -1e30  # an additive mask entry at or below this hides the key


class ScoresChain:
    """What lies between the first matmul and the softmax."""

    def __init__(self):
        self.scale, self.softcap, self.mask, self.matmul = 1.0, 0.0, None, None


def _peel_softcap(value: Value, chain: ScoresChain) -> Value:
    """scores for value = c * tanh(scores / c)."""
    outer = made_by(value, "mul")
    split = split_operands(outer, lambda v: made_by(v, "tanh") is not None) if outer else None
    cap = constant(split[1]) if split else None
    inner = made_by(made_by(split[0], "tanh").inputs[0], "div") if cap else None
    if inner is None or constant(inner.inputs[1]) != cap:
        return value
    chain.softcap = float(cap)
    return inner.inputs[0]


def _is_scalar_constant(value: Value) -> bool:
    return value.type.rank == 0 and constant(value) is not None and not isinstance(constant(value), bool)


def _peel_scale_and_reshapes(value: Value, chain: ScoresChain) -> Value:
    while True:
        node = made_by(value, "mul", "div", "reshape")
        if node is None:
            return value
        if node.op == "reshape":
            value = node.inputs[0]
            continue
        split = split_operands(node, _is_scalar_constant)
        if split is None or (node.op == "div" and split[0] is not node.inputs[1]):
            return value
        factor = constant(split[0])
        chain.scale = chain.scale * factor if node.op == "mul" else chain.scale / factor
        value = split[1]


def _scores_chain(softmax: Node) -> ScoresChain | None:
    """Peel mask, softcap, scale and reshapes off the softmax input, in that order, to a matmul."""
    add = made_by(softmax.inputs[0], "add")
    candidates = [(softmax.inputs[0], None)] + ([tuple(add.inputs), tuple(add.inputs[::-1])] if add else [])
    for scores, mask in candidates:
        chain = ScoresChain()
        chain.mask = mask
        chain.matmul = made_by(_peel_scale_and_reshapes(_peel_softcap(scores, chain), chain), "matmul")
        if chain.matmul is not None:
            return chain
    return None


def _only_path(start: Value, end: Node, users: Users, graph: Graph) -> list[Node] | None:
    """The nodes from `start` to `end` if each value on the way has one reader (the next node)."""
    path, value = [], start
    while len(path) < 16:
        user = sole_user(users, value, graph)
        if user is None or len(user.outputs) != 1:
            return None
        path.append(user)
        if user is end:
            return path
        value = user.output
    return None


def _probs_matmul(softmax: Node, users: Users, graph: Graph) -> Node | None:
    """The matmul(probs, v) the softmax feeds as first operand (through a reshape or not)."""
    probs = softmax.output
    user = sole_user(users, probs, graph)
    if user is not None and user.op == "reshape":
        probs, user = user.output, sole_user(users, user.output, graph)
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


def _bool_mask(mask: Value | None) -> Value | None:
    """The bool mask behind where(visible, 0, very negative), else the mask as it is."""
    where = made_by(mask, "where")
    if where is None:
        return mask
    hidden = constant(where.inputs[2])
    if constant(where.inputs[1]) == 0 and hidden is not None and hidden <= VERY_NEGATIVE:
        return where.inputs[0]
    return mask


def _fuse_one(graph: Graph, softmax: Node, users: Users) -> bool:
    scores = softmax.inputs[0]
    if scores.type.rank != 4 or not is_last_axis(softmax.attrs["axis"], 4):
        return False
    chain, second = _scores_chain(softmax), _probs_matmul(softmax, users, graph)
    if chain is None or second is None or _only_path(chain.matmul.output, softmax, users, graph) is None:
        return False
    batch, heads, rows, keys = scores.type.shape
    (q, k_t), v = chain.matmul.inputs, second.inputs[1]
    head_dim, value_dim = q.type.shape[-1], v.type.shape[-1]
    shapes = {q: (batch, heads, rows, head_dim), k_t: (batch, heads, head_dim, keys),
              v: (batch, heads, keys, value_dim), chain.matmul.output: scores.type.shape,
              second.inputs[0]: scores.type.shape}
    if not all(_fits(value, shape) for value, shape in shapes.items()):
        return False
    out_shape = (batch, heads, rows, value_dim)
    out_user = sole_user(users, second.output, graph)
    last = out_user if out_user is not None and out_user.op == "reshape" and has_shape(
        out_user.output, out_shape) else second
    new_nodes: list[Node] = []
    q, k_t, v = (_as_4d(graph, value, shapes[value], new_nodes) for value in (q, k_t, v))
    k = graph.create("permute", [k_t], {"perm": (0, 1, 3, 2)})
    attention = graph.create("attention", [q, k.output, v, _bool_mask(chain.mask), None],
                             {"scale": chain.scale, "softcap": chain.softcap, "causal": False})
    new_nodes += [k, attention]
    result = attention.output
    if last is second and not has_shape(second.output, out_shape):
        flat = graph.create("reshape", [result], {"shape": second.output.type.shape})
        new_nodes.append(flat)
        result = flat.output
    insert_before(graph, last, new_nodes)
    replace_value(graph, last.output, result)
    return True


def fuse_attention_pattern(graph: Graph) -> Graph:
    """Rewrite each matmul/softmax/matmul attention into `attention`, in place; dead nodes are removed."""
    users = graph.users()
    for softmax in [n for n in graph.nodes if n.op == "softmax"]:
        _fuse_one(graph, softmax, users)
    return eliminate_dead_code(graph)
