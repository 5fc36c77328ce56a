"""shard_tensor_parallel: one rank's share of a stateful graph, Megatron style.

Runs on the stateful graph after fusion (and KV-cache insertion). For `world_size` ranks:
- attention by heads: the q/k/v projections (fused or not) are column-parallel, each rank keeps
  its heads' rows; with fewer KV heads than ranks, a KV head is replicated on the ranks whose
  query heads read it. rope, kv_write and attention run on the rank's heads, and the KV buffers
  (graph inputs) shrink to them;
- MLP: gate/up column-parallel, down row-parallel; a mixture's experts (`gathered_matmul` over
  stacked [experts, out, in] weights) alike: every expert's gate/up rows and down columns split
  over the ranks, so each rank computes its share of whichever experts a token routes to (the
  router and the routing weights stay whole on every rank);
- a row-parallel linear (o_proj, down) multiplies the rank's columns and is followed by
  `all_reduce` (its bias, if any, is added after the sum);
- the token embedding by vocab: rank r holds rows [r V/N, (r+1) V/N); a token outside them looks up zeros
  (masked embedding) and `all_reduce` sums the one row that exists. The lm_head is vocab-parallel
  too and `all_gather` concatenates the logits. A tied weight gets one shard for both uses.

Which linears are column-parallel is read from the graph: those whose outputs reach an attention
or a later linear through head-preserving ops only (slices, reshapes, permutes, rope, per-head
norms, elementwise math). The pass then propagates a layout per value (which axis is split, and
into which segments) and rebuilds the graph with local shapes, so every type is re-inferred and
verified. Anything it cannot place raises `ShardingError` naming the op.

The graph is the same on every rank; what differs per rank lives in its weights (the shards and
`tensor_parallel.vocab_rows`), so one graph.kir serves all ranks of an artifact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir import Graph, Node, TensorType, Value, ops_with
from kiln.ir.dims import dims_equal
from kiln.ir.errors import KilnError
from kiln.ir.ops.shape_rules import numel

from .parallel_linears import column_parallel_linears, drops_last_axis, lm_head_linear

VOCAB_ROWS = "tensor_parallel.vocab_rows"
# Ops whose first input may be split (each has a `_<op>` rule below); their other inputs may not.
SPLIT_FIRST_INPUT = {"rope", "rms_norm", "layer_norm", "slice", "reshape", "permute"}
# The axis a parameter spec splits: a linear's [out, in] rows or columns, stacked experts' [experts, out, in].
PARAM_AXES = {"rows": 0, "cols": 1, "expert_rows": 1, "expert_cols": 2}


class ShardingError(KilnError, ValueError):
    """The graph cannot be sharded as asked (head counts, an op with no rule, a quantized weight)."""


@dataclass(frozen=True)
class Segment:
    """A run of `full` entries of the split axis, cut into `parts` equal chunks; rank r keeps chunk
    r * parts // world_size (parts < world_size replicates a chunk, e.g. a KV head)."""

    full: int
    parts: int

    @property
    def local(self) -> int:
        return self.full // self.parts

    def chunk(self, rank: int, world_size: int) -> tuple[int, int]:
        index = rank * self.parts // world_size
        return index * self.local, (index + 1) * self.local


@dataclass(frozen=True)
class Layout:
    """A value split along `axis` (negative: counted from the right, so broadcasting aligns it)."""

    axis: int
    segments: tuple[Segment, ...]


def shard_tensor_parallel(graph: Graph, rank: int, world_size: int) -> Graph:
    """Rank `rank`'s graph (a new Graph with its weight shards attached) of `world_size` ranks."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank} is not in a world of {world_size} ranks")
    quantized = sorted({n.op for n in graph.nodes if n.op.endswith("_q")})
    if quantized:
        raise ShardingError(
            f"tensor parallelism does not shard quantized ops {quantized} yet. "
            "Fix: compile without --quantize, or with --tensor-parallel 1"
        )
    return _Sharder(graph, rank, world_size).run()


class _Sharder:
    def __init__(self, graph: Graph, rank: int, world_size: int):
        self.src, self.rank, self.world = graph, rank, world_size
        self.out = Graph()
        self.out.symbols = dict(graph.symbols)
        self.out.meta = {**graph.meta, "tensor_parallel": {"world_size": world_size}}
        self.env: dict[int, Value] = {}  # source value -> rebuilt value
        self.layouts: dict[int, Layout] = {}  # rebuilt value -> its layout (absent: replicated)
        self.param_specs: dict[str, tuple] = {}
        self.column = column_parallel_linears(graph)
        self.lm_head = lm_head_linear(graph)

    # -- driver ---------------------------------------------------------------------------
    def run(self) -> Graph:
        for v in self.src.inputs:
            if v.name in ("tokens", "positions", "slots", "tree"):  # replicated (slots, tree: token trees)
                self.env[id(v)] = self.out.add_input(v.name, v.type)
        for node in self.src.nodes:
            self._rebuild(node)
        order = {v.name: i for i, v in enumerate(self.src.inputs)}
        missing = [v.name for v in self.src.inputs if id(v) not in self.env]
        if missing:
            raise ShardingError(f"graph inputs {missing} are read by no kv_write: not a stateful graph")
        self.out.inputs.sort(key=lambda v: order[v.name])
        self.out.outputs = [self._output(v, i) for i, v in enumerate(self.src.outputs)]
        return self.out

    def _output(self, v: Value, index: int) -> Value:
        new = self.env[id(v)]
        if index == 0 and id(new) in self.layouts:
            raise ShardingError(f"the logits %{v.name} would leave the graph sharded")
        return new

    def _value(self, v: Value | None) -> Value | None:
        if v is None:
            return None
        if id(v) not in self.env:
            if v.name not in self.src.params:
                raise ShardingError(f"%{v.name} is neither a parameter nor computed before its use")
            self.env[id(v)] = self._param(v.name, ("replicated",))
        return self.env[id(v)]

    def _layout(self, v: Value | None) -> Layout | None:
        return None if v is None else self.layouts.get(id(v))

    def _emit(self, op: str, inputs, attrs: dict, layout: Layout | None = None) -> Value:
        node = self.out.append(self.out.create(op, inputs, attrs))
        for v in node.outputs:
            if layout is not None:
                self.layouts[id(v)] = layout
        return node.outputs[0] if len(node.outputs) == 1 else node.outputs

    # -- parameters -----------------------------------------------------------------------
    def _param(self, name: str, spec: tuple) -> Value:
        """The rank's shard of parameter `name`: spec is ("replicated",), ("rows", segments) or
        ("cols", segments). A parameter is sharded one way only (a tied weight must agree)."""
        if name in self.param_specs:
            if self.param_specs[name] != spec:
                raise ShardingError(f"parameter %{name} is used both as {self.param_specs[name][0]} and {spec[0]}")
            return self.out.params[name]
        self.param_specs[name] = spec
        tensor = self.src.weights[name]
        if spec[0] != "replicated":
            axis = PARAM_AXES[spec[0]]
            pieces, start = [], 0
            for seg in spec[1]:
                lo, hi = seg.chunk(self.rank, self.world)
                pieces.append(tensor.narrow(axis, start + lo, hi - lo))
                start += seg.full
            tensor = torch.cat(pieces, dim=axis).contiguous() if len(pieces) > 1 else pieces[0].contiguous()
        return self.out.add_param(name, tensor)

    # -- per-op rules ---------------------------------------------------------------------
    def _rebuild(self, node: Node) -> None:
        if node.op == "linear":
            result = self._linear(node)
        elif node.op == "embedding":
            result = self._embedding(node)
        elif node.op == "kv_write":
            result = self._kv_write(node)
        elif node.op == "gathered_matmul":
            result = self._experts(node)
        else:
            inputs = [self._value(v) for v in node.inputs]
            layouts = [self._layout(v) for v in inputs]
            if not any(layouts):
                result = self._emit(node.op, inputs, dict(node.attrs))
            else:
                result = self._sharded_op(node, inputs, layouts)
        results = result if isinstance(result, (tuple, list)) else (result,)
        for old, new in zip(node.outputs, results):
            self.env[id(old)] = new

    def _linear(self, node: Node) -> Value:
        x, weight, bias = node.inputs
        if weight.name not in self.src.params:
            raise ShardingError(f"linear %{node.output.name}: its weight %{weight.name} is computed, not a parameter")
        x_new, layout = self._value(x), self._layout(self._value(x))
        if layout is not None:  # row-parallel: this rank's columns, then the sum over ranks
            if layout.axis != -1:
                raise ShardingError(f"linear %{node.output.name}: input split on axis {layout.axis}, not the features")
            partial = self._emit("linear", [x_new, self._param(weight.name, ("cols", layout.segments))], {})
            total = self._emit("all_reduce", [partial], {"world_size": self.world})
            return self._emit("add", [total, self._value(bias)], {}) if bias is not None else total
        if node in self.column:
            segments = self._column_segments(node)
        elif node is self.lm_head:
            segments = (self._vocab_segment(weight),)
        else:
            return self._emit("linear", [x_new, self._value(weight), self._value(bias)], {})
        spec = ("rows", segments)
        out = self._emit(
            "linear",
            [x_new, self._param(weight.name, spec), self._param(bias.name, spec) if bias is not None else None],
            {},
            Layout(-1, segments),
        )
        if node is self.lm_head:
            return self._emit("all_gather", [out], {"axis": -1, "world_size": self.world})
        return out

    def _experts(self, node: Node) -> Value:
        """gathered_matmul as a linear per expert: column-parallel where its output feeds the
        next one (each expert's rows of this rank), row-parallel where its input is split (each
        expert's columns of this rank, then the sum over ranks)."""
        weights, ids, x = node.inputs
        where = f"gathered_matmul %{node.output.name}"
        if weights.name not in self.src.params:
            raise ShardingError(f"{where}: its experts %{weights.name} are computed, not a parameter")
        ids_new, x_new = self._value(ids), self._value(x)
        layout = self._layout(x_new)
        if self._layout(ids_new) is not None:
            raise ShardingError(f"{where}: its expert ids are split")
        if layout is not None:
            if layout.axis != -2:
                raise ShardingError(f"{where}: input split on axis {layout.axis}, not the features")
            experts = self._param(weights.name, ("expert_cols", layout.segments))
            partial = self._emit("gathered_matmul", [experts, ids_new, x_new], {})
            return self._emit("all_reduce", [partial], {"world_size": self.world})
        if node not in self.column:
            return self._emit("gathered_matmul", [self._value(weights), ids_new, x_new], {})
        features = node.output.users[0].output if drops_last_axis(node.output) else node.output
        segments = self._column_segments(node, features if features is not node.output else None)
        experts = self._param(weights.name, ("expert_rows", segments))
        return self._emit("gathered_matmul", [experts, ids_new, x_new], {}, Layout(-2, segments))

    def _vocab_segment(self, weight: Value) -> Segment:
        vocab = weight.type.shape[0]
        if vocab % self.world:
            raise ShardingError(
                f"the vocabulary ({vocab} rows of %{weight.name}) does not split over "
                f"{self.world} ranks. Fix: pick a --tensor-parallel that divides {vocab}"
            )
        return Segment(vocab, self.world)

    def _column_segments(self, node: Node, features: Value | None = None) -> tuple[Segment, ...]:
        """The output's segments: one per slice of the last axis that reads it (fused q/k/v or
        gate/up), else one; a segment that a reshape splits into heads is cut by heads.
        `features`: the value whose last axis is the output features, where not the output."""
        features = node.output if features is None else features
        width = features.type.shape[-1]
        readers = features.users
        if readers and all(
            r.op == "slice" and r.attrs["axis"] in (-1, node.output.type.rank - 1) and r.attrs["step"] == 1
            for r in readers
        ):
            heads: dict[tuple[int, int], int | None] = {}
            for r in readers:
                bounds = (r.attrs["start"], min(r.attrs["end"], width))
                heads[bounds] = heads.get(bounds) or self._heads_after(r.output)
            bounds = sorted(heads)
            if [lo for lo, _ in bounds] != [0] + [hi for _, hi in bounds[:-1]] or bounds[-1][1] != width:
                raise ShardingError(f"the slices of linear %{node.output.name} do not tile its {width} outputs")
            return tuple(self._segment(hi - lo, heads[(lo, hi)], node) for lo, hi in bounds)
        return (self._segment(width, self._heads_after(features), node),)

    def _heads_after(self, value: Value) -> int | None:
        """n where a reader reshapes [..., n * d] into [..., n, d] (attention heads), else None."""
        for reader in value.users:
            if reader.op == "reshape":
                out = reader.output.type.shape
                if len(out) == value.type.rank + 1 and isinstance(out[-2], int):
                    return out[-2]
        return None

    def _segment(self, width: int, heads: int | None, node: Node) -> Segment:
        n = heads or width
        if n % self.world == 0:
            return Segment(width, self.world)
        if heads and self.world % heads == 0:  # fewer KV heads than ranks: replicate them
            return Segment(width, heads)
        what = f"{heads} heads" if heads else f"{width} features"
        raise ShardingError(
            f"linear %{node.output.name} has {what}, which do not split over {self.world} ranks. "
            "Fix: pick a --tensor-parallel that divides (or is a multiple of) the head counts"
        )

    def _embedding(self, node: Node) -> Value:
        weight, ids = node.inputs
        if ids.name != "tokens":  # e.g. GPT-2's position table: small, kept whole
            return self._emit("embedding", [self._value(weight), self._value(ids)], {})
        if weight.name not in self.src.params:
            raise ShardingError(f"embedding %{node.output.name}: its table is computed, not a parameter")
        segment = self._vocab_segment(weight)
        table = self._param(weight.name, ("rows", (segment,)))
        if VOCAB_ROWS not in self.out.params:
            self.out.add_param(VOCAB_ROWS, self._vocab_rows(segment))
        ids = self._value(ids)
        local = self._emit("index", [self.out.params[VOCAB_ROWS], ids], {})
        zero = self._emit("full", [], {"shape": (), "value": 0, "dtype": local.type.dtype})
        inside = self._emit("ge", [local, zero], {})
        rows = self._emit("embedding", [table, self._emit("where", [inside, local, zero], {})], {})
        keep = self._emit("reshape", [inside], {"shape": (*ids.type.shape, 1)})
        nothing = self._emit("full", [], {"shape": (), "value": 0.0, "dtype": rows.type.dtype})
        masked = self._emit("where", [keep, rows, nothing], {})
        return self._emit("all_reduce", [masked], {"world_size": self.world})

    def _vocab_rows(self, segment: Segment) -> torch.Tensor:
        """Each token id's row in this rank's table, -1 where another rank holds it. A table, not
        an offset: a compiler folds a scalar constant into the code, and the code is shared by
        every rank (one AOTInductor package, Inductor's cache); a table stays a weight."""
        lo, hi = segment.chunk(self.rank, self.world)
        rows = torch.full((segment.full,), -1, dtype=torch.int64)
        rows[lo:hi] = torch.arange(hi - lo)
        return rows

    def _kv_write(self, node: Node) -> Value:
        cache, new, positions = node.inputs[:3]  # no block table: a paged layout is not sharded
        new_value = self._value(new)
        layout = self._layout(new_value)
        if cache.name in self.src.params or cache.producer is not None:
            raise ShardingError(f"kv_write %{node.output.name} writes %{cache.name}, which is not a cache input")
        if layout is None or layout.axis != -3:
            raise ShardingError(f"kv_write %{node.output.name}: its keys/values are not split by heads")
        shape = list(cache.type.shape)
        shape[1] = layout.segments[0].local
        self.env[id(cache)] = self.out.add_input(cache.name, TensorType(cache.type.dtype, tuple(shape)))
        self.layouts[id(self.env[id(cache)])] = layout
        return self._emit("kv_write", [self.env[id(cache)], new_value, self._value(positions)], {}, layout)

    def _local_slopes(self, where: str, attrs: dict, q: Layout) -> dict:
        """attention's attributes with the ALiBi slopes of this rank's query heads only."""
        if not attrs["alibi"]:
            return dict(attrs)
        if len(q.segments) != 1 or q.segments[0].full != len(attrs["alibi"]):
            raise ShardingError(f"{where}: its ALiBi slopes do not follow the split of its query heads")
        start, end = q.segments[0].chunk(self.rank, self.world)
        return dict(attrs, alibi=attrs["alibi"][start:end])

    def _sharded_op(self, node: Node, inputs: list, layouts: list) -> Value:
        where = f"{node.op} %{node.outputs[0].name}"
        if node.op == "attention":
            q, k, v = layouts[:3]
            if not (q and k and v and q.axis == k.axis == v.axis == -3) or any(layouts[3:]):
                raise ShardingError(f"{where}: q, k and v must all be split by heads, mask and positions not")
            return self._emit("attention", inputs, self._local_slopes(where, node.attrs, q), q)
        if node.op in ops_with("elementwise"):
            return self._emit(node.op, inputs, dict(node.attrs), self._elementwise_layout(where, inputs, layouts))
        if node.op in SPLIT_FIRST_INPUT:
            if any(layouts[1:]):
                raise ShardingError(f"{where}: only its first input may be split")
            layout = layouts[0]
            rank = inputs[0].type.rank
            return getattr(self, f"_{node.op}")(node, inputs, layout, rank, where)
        if node.op == "add_rms_norm":
            if layouts[2] or layouts[0] != layouts[1] or layouts[0].axis == -1:
                raise ShardingError(f"{where}: x and residual must be split alike, not along the normalized axis")
            return self._emit(node.op, inputs, dict(node.attrs), layouts[0])
        raise ShardingError(
            f"{where} reads a tensor-parallel split value and has no sharding rule. "
            "Fix: compile this model with --tensor-parallel 1"
        )

    def _elementwise_layout(self, where: str, inputs: list, layouts: list) -> Layout:
        split = {part for part in layouts if part is not None}
        if len(split) != 1:
            raise ShardingError(f"{where}: its operands are split differently")
        layout = split.pop()
        for value, part in zip(inputs, layouts):
            if (
                part is None
                and value is not None
                and value.type.rank >= -layout.axis
                and value.type.shape[layout.axis] != 1
            ):
                raise ShardingError(
                    f"{where}: a whole operand %{value.name} meets a split one along axis {layout.axis}"
                )
        return layout

    def _rope(self, node, inputs, layout, rank, where):
        if layout.axis != -3:
            raise ShardingError(f"{where}: rope's input must be split by heads")
        return self._emit("rope", inputs, dict(node.attrs), layout)

    def _rms_norm(self, node, inputs, layout, rank, where):
        if layout.axis == -1:
            raise ShardingError(f"{where}: normalizes along the split axis")
        return self._emit(node.op, inputs, dict(node.attrs), layout)

    _layer_norm = _rms_norm

    def _permute(self, node, inputs, layout, rank, where):
        perm = [p % rank for p in node.attrs["perm"]]
        new_axis = perm.index(layout.axis % rank) - rank
        return self._emit("permute", inputs, dict(node.attrs), Layout(new_axis, layout.segments))

    def _slice(self, node, inputs, layout, rank, where):
        attrs = dict(node.attrs)
        if attrs["axis"] % rank != layout.axis % rank:
            return self._emit("slice", inputs, attrs, layout)
        full = sum(s.full for s in layout.segments)
        start, end = attrs["start"], min(attrs["end"], full)
        offset, local_offset, picked, local_start = 0, 0, [], None
        for seg in layout.segments:
            if start <= offset and offset + seg.full <= end and attrs["step"] == 1:
                local_start = local_offset if local_start is None else local_start
                picked.append(seg)
            offset, local_offset = offset + seg.full, local_offset + seg.local
        if not picked or sum(s.full for s in picked) != end - start:
            raise ShardingError(f"{where}: slices [{start}, {end}) across the split of its input")
        attrs.update(start=local_start, end=local_start + sum(s.local for s in picked))
        return self._emit("slice", inputs, attrs, Layout(layout.axis, tuple(picked)))

    def _reshape(self, node, inputs, layout, rank, where):
        axis = layout.axis % rank
        src, dst = node.inputs[0].type.shape, node.output.type.shape
        before = numel(src[:axis])
        new_axis = next((i for i in range(len(dst) + 1) if dims_equal(numel(dst[:i]), before)), None)
        if new_axis is None or new_axis == len(dst) or not isinstance(dst[new_axis], int):
            raise ShardingError(f"{where}: cannot follow the split axis through this reshape")
        size, whole = dst[new_axis], src[axis]
        if size == whole and dims_equal(numel(dst[new_axis:]), numel(src[axis:])):  # only unit axes move
            shape = list(dst)
            shape[new_axis] = sum(s.local for s in layout.segments)
            return self._emit("reshape", inputs, {"shape": tuple(shape)}, Layout(new_axis - len(dst), layout.segments))
        if len(layout.segments) != 1:
            raise ShardingError(f"{where}: reshapes an axis made of several segments")
        seg = layout.segments[0]
        if not (size % seg.parts == 0 and (size % whole == 0 or whole % size == 0)):
            raise ShardingError(f"{where}: the split axis of {whole} does not map onto {size}")
        if size % whole == 0 and not dims_equal(numel(dst[new_axis:]), numel(src[axis:])):
            raise ShardingError(f"{where}: merges the split axis with axes before it")
        shape = list(dst)
        shape[new_axis] = size // seg.parts
        return self._emit(
            "reshape", inputs, {"shape": tuple(shape)}, Layout(new_axis - len(dst), (Segment(size, seg.parts),))
        )
