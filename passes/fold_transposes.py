"""fold_transposes: a matmul by a (transposed) weight matrix -> `linear`.

    matmul(x, W)                with W a parameter [in, out] read only here (GPT-2's Conv1D)
        -> linear(x, W')        W' = W transposed once, now, into linear's [out, in] layout
    matmul(x, permute(W, [1, 0]))   with W [out, in]
        -> linear(x, W)         the transpose is folded into linear's layout, nothing copied
`linear` is where every backend puts its fast kernels (GEMV for decode, packed or quantized
weights), so weights in its layout reach them. The transposed parameter is named
`<name>.transposed`. Bias adds and the flatten/unflatten reshapes around GPT-2's linears are
left to fuse_bias_activation and fold_linear_reshapes.
"""

from __future__ import annotations

from kiln.ir import Graph, Value

from .dce import eliminate_dead_code
from .match import made_by


def _transposed_weight(graph: Graph, b: Value) -> Value | None:
    """b's matrix in [out, in] layout, or None if b is not a weight matrix."""
    permute = made_by(b, "permute")
    if permute is not None and tuple(p % 2 for p in permute.attrs["perm"]) == (1, 0):
        return permute.inputs[0]
    if b.name in graph.params and b.name in graph.weights and b.type.rank == 2 and len(b.users) == 1:
        tensor = graph.weights[b.name].t().contiguous()
        return graph.add_param(graph.fresh_name(f"{b.name}.transposed"), tensor)
    return None


def fold_transposes(graph: Graph) -> Graph:
    """Rewrite matmuls by weight matrices into `linear`, in place; dead nodes and weights are removed."""
    for node in [n for n in graph.nodes if n.op == "matmul"]:
        x, b = node.inputs
        if b.type.rank != 2:
            continue
        weight = _transposed_weight(graph, b)
        if weight is None:
            continue
        linear = graph.create("linear", [x, weight, None])
        graph.insert_before(node, linear)
        graph.replace_all_uses(node.output, linear.output)
    return eliminate_dead_code(graph)
