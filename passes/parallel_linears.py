"""Which linears tensor parallelism splits by columns, read off the stateful graph
(passes/shard_tensor_parallel.py): those whose outputs feed an attention or another linear through
head-preserving ops; the rest are row-parallel or whole. Experts' `gathered_matmul` counts as a
linear over its activations input."""

from __future__ import annotations

from kiln.ir import Graph, Node, Value, ops_with
from kiln.ir.dims import dims_equal


def column_parallel_linears(graph: Graph) -> set:
    """Linears (and experts' gathered_matmul) whose outputs feed an attention or another linear
    through head-preserving ops."""
    column = set()
    for node in graph.nodes:
        if node.op == "attention":
            for v in node.inputs[:3]:
                if v.producer is not None and v.producer.op == "kv_write":
                    v = v.producer.inputs[1]
                column |= source_linears(v) or set()
        elif node.op in LINEAR_INPUT:
            sources = source_linears(node.inputs[LINEAR_INPUT[node.op]], through_attention=True)
            column |= sources or set()
    return column


LINEAR_INPUT = {"linear": 0, "gathered_matmul": 2}  # which input is the activations


def drops_last_axis(value: Value) -> bool:
    """Whether `value` [rows, out, 1] is read by one reshape to [rows, out] (experts' output)."""
    users = value.users
    if len(users) != 1 or users[0].op != "reshape":
        return False
    shape = users[0].output.type.shape
    return (
        value.type.shape[-1] == 1 and len(shape) == value.type.rank - 1 and dims_equal(shape[-1], value.type.shape[-2])
    )


def source_linears(value: Value, through_attention: bool = False) -> set | None:
    """The linears `value` is computed from by head-preserving ops (None: it depends on anything
    else, e.g. a residual stream or a norm over the features)."""
    found, stack, seen = set(), [value], set()
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        node = v.producer
        if node is None:
            if v.type.rank == 0 or all(d == 1 for d in v.type.shape[-1:]):
                continue  # a scalar or broadcast constant
            return None
        if node.op in LINEAR_INPUT:
            found.add(node)
        elif node.op == "attention" and through_attention:
            continue  # o_proj reads attention's heads: a row-parallel linear with no linear sources
        elif node.op in ops_with("constant"):
            continue
        elif node.op in ops_with("elementwise") or node.op in ("slice", "reshape", "permute"):
            stack.extend(i for i in node.inputs if i is not None)
        elif node.op in ("rope", "rms_norm") and node.inputs[0].type.rank == 4:
            stack.append(node.inputs[0])
        else:
            return None
    return found


def lm_head_linear(graph: Graph) -> Node | None:
    """The linear the logits come from (through elementwise ops such as a final softcap)."""
    value = graph.outputs[0]
    while value.producer is not None and value.producer.op in ops_with("elementwise"):
        value = next(
            (i for i in value.producer.inputs if i is not None and i.producer is not None and i.producer.op != "full"),
            None,
        )
        if value is None:
            return None
    return value.producer if value.producer is not None and value.producer.op == "linear" else None
