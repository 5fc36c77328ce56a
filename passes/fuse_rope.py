"""fuse_rope: Hugging Face's rotary embedding -> `rope` with constant cos/sin tables.

Captured, per layer and per q/k:
    freqs = positions[..., None] * inv_freq; emb = cat(freqs, freqs); cos, sin = cos(emb), sin(emb)
    out = x * cos[:, None] + cat(-x[..., h:], x[..., :h]) * sin[:, None]       (rotate_half)
and with partial rotary: out = cat(that on x[..., :r], x[..., r:]).
After: out = rope(x, positions, cos_table, sin_table), the tables params of
[max_positions, r / 2] holding cos/sin at positions 0..max_positions-1, where max_positions is
the upper bound of the positions' seq symbol (the compiled max_seq_len). The per-step
trigonometry and the rotate-half shuffles leave the graph.

The tables are not computed by a formula of Kiln's own: the graph's cos/sin subgraphs are run
by the reference kernels on positions 0..max_positions-1, so whatever the model does (scaled
inv_freq as in Llama 3, an attention scaling factor, per-layer-type bases as in Gemma 3) is
reproduced exactly. This is only sound when cos/sin at (b, t) depend on positions[b, t] alone,
which `position_function` checks: elementwise math, casts, unit-dim reshapes and last-axis
concats/slices over the positions input and constants. Tables with equal contents are shared
(one pair per distinct rope in the model).
"""

from __future__ import annotations

import sympy
import torch

from kiln.ir import Graph, Node, Value, get_op, ops_with, to_torch
from kiln.ir.dims import dims_equal, evaluate

from .dce import eliminate_dead_code
from .match import has_shape, is_last_axis, made_by, sole_reader, split_operands


def _halves_of(rotated: Value) -> tuple[Value, int] | None:
    """(x, h) if `rotated` is rotate_half(x) = cat(-x[..., h:], x[..., :h]) with x's last dim 2h."""
    cat = made_by(rotated, "concat")
    if cat is None or len(cat.inputs) != 2 or not is_last_axis(cat.attrs["axis"], rotated.type.rank):
        return None
    neg = made_by(cat.inputs[0], "neg")
    upper, lower = made_by(neg.inputs[0] if neg else None, "slice"), made_by(cat.inputs[1], "slice")
    if upper is None or lower is None or upper.inputs[0] is not lower.inputs[0]:
        return None
    x = lower.inputs[0]
    dim = x.type.shape[-1]
    if not isinstance(dim, int) or dim % 2:
        return None
    h = dim // 2
    rank = x.type.rank
    ok = all(is_last_axis(s.attrs["axis"], rank) and s.attrs["step"] == 1 for s in (upper, lower))
    ok = ok and (lower.attrs["start"], min(lower.attrs["end"], dim)) == (0, h)
    ok = ok and (upper.attrs["start"], min(upper.attrs["end"], dim)) == (h, dim)
    return (x, h) if ok else None


def _rotary_terms(add: Node) -> tuple[Value, Value, Value] | None:
    """(x, cos, sin) if `add` is x * cos + rotate_half(x) * sin (any operand order)."""
    products = [made_by(v, "mul") for v in add.inputs]
    if None in products:
        return None
    for first, second in (products, products[::-1]):
        split = split_operands(second, lambda v: _halves_of(v) is not None)
        if split is None:
            continue
        x = _halves_of(split[0])[0]
        direct = split_operands(first, lambda v, x=x: v is x)
        if direct is not None:
            return x, direct[1], split[1]
    return None


def _is_unit_reshape(node: Node) -> bool:
    """A reshape that only adds or drops dims of size 1 (the element order and indexing stay)."""

    def drop_ones(shape):
        return [d for d in shape if d != 1]

    before, after = drop_ones(node.inputs[0].type.shape), drop_ones(node.output.type.shape)
    return len(before) == len(after) and all(dims_equal(a, b) for a, b in zip(before, after))


def _is_symbolic(attr) -> bool:
    return any(_is_symbolic(a) for a in attr) if isinstance(attr, tuple) else isinstance(attr, sympy.Expr)


def _allowed(node: Node) -> bool:
    if node.op in ops_with("elementwise"):
        return True
    if node.op in ops_with("constant"):  # arange(seq) would be the token's index, not its position
        return not any(_is_symbolic(a) for a in node.attrs.values())
    if node.op == "reshape":
        return _is_unit_reshape(node)
    if node.op in ("concat", "slice"):
        return is_last_axis(node.attrs["axis"], node.output.type.rank) and all(
            isinstance(v.type.shape[-1], int) for v in node.inputs
        )
    return False


def position_function(graph: Graph, value: Value) -> tuple[Value, list[Node]] | None:
    """(positions input, the nodes computing `value` in graph order) if `value` depends on one
    integer graph input of rank 2 and on constants only, through ops that keep each (b, t) to
    itself."""
    inputs, nodes, seen, stack = set(), [], set(), [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer
        if node is None:
            if v.name in graph.weights and not v.type.symbols():
                continue
            if v not in graph.inputs or v.type.dtype not in ("i64", "i32") or v.type.rank != 2:
                return None
            inputs.add(v)
            continue
        if not _allowed(node):
            return None
        nodes.append(node)
        stack += [i for i in node.inputs if i is not None]
    if len(inputs) != 1:
        return None
    return inputs.pop(), sorted(nodes, key=graph.position)


class RopeTables:
    """Computes the cos/sin tables and makes them params: each node of the cos/sin subgraphs is
    run once (layers share them), and equal tables share one param pair."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.env = {id(v): graph.weights[name] for name, v in graph.params.items() if name in graph.weights}
        self.made: list[tuple[torch.Tensor, torch.Tensor, Value, Value]] = []

    def evaluate(self, value: Value, positions: Value, nodes: list[Node], max_positions: int) -> torch.Tensor:
        """`value` computed by the reference kernels with positions = [[0, 1, ..., max_positions-1]]."""
        batch, seq = positions.type.shape
        bindings = {d.name: size for d, size in ((batch, 1), (seq, max_positions)) if isinstance(d, sympy.Symbol)}

        def concrete(a):
            if isinstance(a, tuple):
                return tuple(concrete(x) for x in a)
            return evaluate(a, bindings) if isinstance(a, sympy.Expr) else a

        env = self.env
        env.setdefault(id(positions), torch.arange(max_positions, dtype=to_torch(positions.type.dtype))[None])
        with torch.no_grad():
            for node in nodes:
                if id(node.output) not in env:
                    args = [None if v is None else env[id(v)] for v in node.inputs]
                    env[id(node.output)] = get_op(node.op).reference(
                        *args, **{k: concrete(a) for k, a in node.attrs.items()}
                    )
        return env[id(value)]

    def table(self, value: Value, x: Value) -> tuple[Value, torch.Tensor] | None:
        """(positions, table [max_positions, half]) if `value` is a cos/sin of positions laid out
        [batch, 1, seq, 2 * half] against x [batch, heads, seq, 2 * half], its two halves equal."""
        found = position_function(self.graph, value)
        if found is None:
            return None
        positions, nodes = found
        batch, seq = positions.type.shape
        rot = x.type.shape[-1]
        if not has_shape(value, (batch, 1, seq, rot)) or x.type.rank != 4:
            return None
        if not (dims_equal(x.type.shape[0], batch) and dims_equal(x.type.shape[2], seq)):
            return None
        if not isinstance(seq, sympy.Symbol) or seq.name not in self.graph.symbols:
            return None  # no bound on the positions, so no table size
        max_positions = self.graph.symbols[seq.name].max
        full = self.evaluate(value, positions, nodes, max_positions).reshape(max_positions, rot)
        half = rot // 2
        if not torch.equal(full[:, :half], full[:, half:]):
            return None  # not the rotate-half layout (cat(freqs, freqs))
        return positions, full[:, :half]

    def params_for(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[Value, Value]:
        """The param pair holding these tables (an existing one if equal tables were made)."""
        for known_cos, known_sin, cos_param, sin_param in self.made:
            if torch.equal(known_cos, cos) and torch.equal(known_sin, sin):
                return cos_param, sin_param
        index, graph = len(self.made), self.graph
        cos_param = graph.add_param(graph.fresh_name(f"rope.{index}.cos_table"), cos.contiguous())
        sin_param = graph.add_param(graph.fresh_name(f"rope.{index}.sin_table"), sin.contiguous())
        self.made.append((cos, sin, cos_param, sin_param))
        return cos_param, sin_param


def _partial_rotary_whole(out: Value, x_rot: Value, graph: Graph) -> tuple[Value, Node] | None:
    """(x, the concat) if out is the rotated part of cat(rope(x[..., :r]), x[..., r:])."""
    head = made_by(x_rot, "slice")
    cat = sole_reader(out, graph)
    if head is None or cat is None or cat.op != "concat" or len(cat.inputs) != 2 or cat.inputs[0] is not out:
        return None
    tail = made_by(cat.inputs[1], "slice")
    x = head.inputs[0]
    rank, rot = x.type.rank, x_rot.type.shape[-1]
    if tail is None or tail.inputs[0] is not x or not is_last_axis(cat.attrs["axis"], rank):
        return None
    same_axis = all(is_last_axis(s.attrs["axis"], rank) and s.attrs["step"] == 1 for s in (head, tail))
    if not (same_axis and head.attrs["start"] == 0 and head.attrs["end"] == rot and tail.attrs["start"] == rot):
        return None
    return x, cat


def fuse_rope(graph: Graph) -> Graph:
    """Rewrite every rotary embedding above into `rope`, in place; dead nodes are removed."""
    tables = RopeTables(graph)
    for add in [n for n in graph.nodes if n.op == "add"]:
        terms = _rotary_terms(add)
        if terms is None:
            continue
        x, cos, sin = terms
        cos_table, sin_table = tables.table(cos, x), tables.table(sin, x)
        if cos_table is None or sin_table is None or cos_table[0] is not sin_table[0]:
            continue
        positions = cos_table[0]
        anchor, whole = add, _partial_rotary_whole(add.output, x, graph)
        if whole is not None:
            x, anchor = whole
        cos_param, sin_param = tables.params_for(cos_table[1], sin_table[1])
        rope = graph.create("rope", [x, positions, cos_param, sin_param])
        graph.insert_before(anchor, rope)
        graph.replace_all_uses(anchor.output, rope.output)
    return eliminate_dead_code(graph)
