"""How each `linear`/`matmul` weight is stored, and how its product is spelled, for tinygrad's CPU kernels.

Weights are constants, so the backend stores them in the form its kernels read fastest, and
writes each product so that tinygrad 0.14's hand-coded optimizer (codegen/opt/heuristic.py)
picks good loops for a decode step's matrix-vector product. Measured per kernel on GPT-2 small
(docs/backend-tinygrad.md has the table), three rules:
- **[out, in] storage**: with the reduction axis contiguous every output is a dot product over
  float4 loads; GPT-2's Conv1D weights come as [in, out] (a `matmul` in the IR), which makes
  the optimizer walk rows with a stride of `out` floats (0.9 GB/s against 4.6). They are stored
  transposed.
- **rows padded to a multiple of 64**: the optimizer only upcasts (several outputs per loop)
  and splits over threads an output axis divisible by 3 or 4; GPT-2's vocabulary (50257 =
  29 x 1733) got neither: 2.3 GB/s for the largest kernel of the step. Padded with zero rows,
  the extra outputs are sliced off.
- **split-K under 2048 outputs**: below 1024 outputs the optimizer upcasts nothing (768-wide
  projections ran at 2.1 GB/s). Such products are computed as `splits` partial dot products
  per output, [.., splits, out] in one kernel, then summed in a second, tiny one.
A fourth supersedes the dot-product form for the weights read only by `linear` (and a tied
embedding's gather) or as a transposed `matmul`:
- **16 rows interleaved**: stored [rows/16, in, 16], the 16 outputs of a block side by side
  for each k, so one contiguous run of 16 floats feeds 16 accumulators; kernel_opts.py gives
  these products their loops (lanes x16, no split-K needed). The decode GEMVs then stream the
  weights at about twice the dot-product form's speed.
`linear_q`'s codes read by nothing else are stored the same way, packed into 32-bit words, with
their scales and zero points interleaved to match (packed_codes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinygrad import Tensor, dtypes

from kiln.ir import Graph, Value

from .packed_codes import packed_codes, packs

ROW_MULTIPLE = 64
SPLIT_K_BELOW = 2048  # outputs under which a product is split along K
MAX_SPLITS = 16
LANES = 16  # rows interleaved per block (kernel_opts.LANES)
INTERLEAVED_READERS = {("linear", 1), ("embedding", 0), ("matmul", 1)}


@dataclass(frozen=True)
class StoredWeight:
    """How one parameter is stored: transposed from the graph's view, and rows padded to `rows`."""

    transposed: bool = False
    rows: int | None = None  # stored row count when padded, else None
    lanes: int | None = None  # stored [rows/lanes, in, lanes] when interleaved, else [rows, in]
    packed: int | None = None  # the bits of codes packed into words (packed_codes.py), else None


class WeightLayouts:
    """The storage of every product weight, and the products written against it."""

    def __init__(self, stored: dict[str, StoredWeight]):
        self.stored = stored

    @property
    def transposed(self) -> dict[str, bool]:
        return {name: s.transposed for name, s in self.stored.items()}

    def _plan(self, value: Value | None) -> StoredWeight:
        if value is None or value.producer is not None:
            return StoredWeight()
        return self.stored.get(value.name, StoredWeight())

    def packed_bits(self, value: Value | None) -> int | None:
        """The code width of a linear_q weight stored packed (packed_codes.py), else None."""
        return self._plan(value).packed

    def linear(self, weight_value: Value, x: Tensor, weight: Tensor, out_features: int) -> Tensor:
        """x @ W.T for the graph's W [out, in], stored [rows >= out, in] (or interleaved)."""
        if self._plan(weight_value).lanes:
            return _unpadded(interleaved_product(x, weight), out_features)
        return _unpadded(matvec(x, weight), out_features)

    def embedding(self, weight_value: Value, weight: Tensor, ids: Tensor) -> Tensor:
        """weight[ids] for the graph's weight [rows, dim], whatever its storage."""
        flat = ids.reshape(-1).cast(dtypes.int32)
        lanes = self._plan(weight_value).lanes
        if not lanes:
            rows = weight[flat]
        else:  # the ids' blocks [T, dim, lanes], then each id's lane of its block
            blocks, dim = weight.shape[0], weight.shape[1]
            block_rows = weight.reshape(blocks, dim * lanes)[flat // lanes].reshape(-1, dim, lanes)
            lane = (flat % lanes).reshape(-1, 1, 1) == Tensor.arange(lanes, dtype=dtypes.int32).reshape(1, 1, lanes)
            rows = lane.where(block_rows, 0).sum(-1)
        return rows.reshape(*ids.shape, rows.shape[-1])

    def matmul(self, b_value: Value, a: Tensor, b: Tensor) -> Tensor:
        """a @ B for the graph's B [in, out]; a transposed B is stored [rows >= out, in]."""
        plan = self._plan(b_value)
        if not plan.transposed:
            return a @ b
        product = interleaved_product(a, b) if plan.lanes else matvec(a, b)
        return _unpadded(product, b_value.type.shape[-1])


def _unpadded(y: Tensor, out_features: int) -> Tensor:
    """The first out_features outputs of a product over padded rows. The padded product is made
    contiguous first: sliced lazily, tinygrad would shrink the kernel back to out_features."""
    return y if y.shape[-1] == out_features else y.contiguous()[..., :out_features]


def split_count(out_features: int, in_features: int) -> int:
    """Partial sums per output for a product with this weight shape (1: no split)."""
    splits = 1
    while out_features * splits < SPLIT_K_BELOW and splits < MAX_SPLITS and in_features % (splits * 8) == 0:
        splits *= 2
    return splits


def matvec(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T for weight [out, in], split along `in` when the output is narrow.

    x is made contiguous first: left lazy, tinygrad fuses the ops producing it (an activation, a
    norm) into the product's loads and recomputes them for every output row; SmolLM2's down
    projection, recomputing silu(gate) * up 2304 times, ran at 1 GB/s.
    """
    x = x.contiguous()
    out_features, in_features = weight.shape
    if not (isinstance(out_features, int) and isinstance(in_features, int)):
        return x @ weight.T
    splits = split_count(out_features, in_features)
    if splits == 1:
        return x @ weight.T
    part = in_features // splits
    xs = x.reshape(*x.shape[:-1], splits, 1, part)
    ws = weight.reshape(out_features, splits, part).permute(1, 0, 2)  # [splits, out, part]
    partial = (xs * ws).sum(-1).contiguous()  # [.., splits, out]: one kernel of splits * out dot products
    return partial.sum(-2)


def interleaved_product(x: Tensor, weight: Tensor) -> Tensor:
    """x @ W.T for W stored interleaved, [rows/LANES, in, LANES]: [..., rows].

    x is made contiguous first, as in matvec."""
    x = x.contiguous()
    blocks, in_features, lanes = weight.shape
    y = (x.reshape(*x.shape[:-1], 1, in_features, 1) * weight).sum(-2)  # [..., blocks, lanes]
    return y.reshape(*x.shape[:-1], blocks * lanes)


def plan_packed_codes(graph: Graph, readers: dict[str, set[tuple[str, int]]]) -> dict[str, StoredWeight]:
    """linear_q weights whose codes, scales and zero points nothing else reads, stored packed."""
    stored = {}
    for node in graph.nodes:
        if node.op != "linear_q":
            continue
        qweight, scales, zeros = node.inputs[1:4]
        params = [v for v in (qweight, scales, zeros) if v is not None]
        if any(v.producer is not None or v.name not in graph.params for v in params):
            continue
        if any(
            readers[v.name] - {("linear_q", i), ("embedding_q", j)} for v, i, j in zip(params, (1, 2, 3), (0, 1, 3))
        ):
            continue  # read by another op: keep linear_q's layout (a tied embedding_q reads the packed one)
        bits, group_size = node.attrs["bits"], node.attrs["group_size"]
        n, k = scales.type.shape[0], scales.type.shape[1] * group_size
        if not all(isinstance(d, int) for d in (*qweight.type.shape, *scales.type.shape)):
            continue
        if k != qweight.type.shape[1] * 8 // bits or not packs(n, k, bits, group_size):
            continue
        stored[qweight.name] = StoredWeight(packed=bits)
        for v in params[1:]:
            stored[v.name] = StoredWeight(lanes=LANES)
    return stored


def plan_weights(graph: Graph) -> WeightLayouts:
    """Which product weights to transpose or pad.

    A matmul's right operand is stored transposed ([out, in]) when nothing else reads it; any
    2-d weight read by `linear` or stored transposed gets its rows padded to a multiple of 64
    (gathers such as a tied embedding's read only rows < vocab, so they are unaffected); one
    read only by `linear`, a gather or as a transposed matmul is also interleaved (LANES).
    """
    readers: dict[str, set[tuple[str, int]]] = {}
    for node in graph.nodes:
        for index, v in enumerate(node.inputs):
            if v is not None and v.producer is None and v.name in graph.params:
                readers.setdefault(v.name, set()).add((node.op, index))
    stored = {}
    for name, uses in readers.items():
        value = graph.params[name]
        if value.type.rank != 2 or not all(isinstance(d, int) for d in value.type.shape):
            continue
        transposed = uses == {("matmul", 1)}
        if not transposed and ("linear", 1) not in uses:
            continue
        if ("matmul", 1) in uses and not transposed:
            continue  # read both ways: keep the graph's layout, no padding
        rows = value.type.shape[1] if transposed else value.type.shape[0]
        padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
        lanes = LANES if uses <= INTERLEAVED_READERS else None
        stored[name] = StoredWeight(transposed, padded if padded != rows else None, lanes)
    return WeightLayouts(stored | plan_packed_codes(graph, readers))


def stored_weight(name: str, tensor: torch.Tensor, layouts: WeightLayouts) -> torch.Tensor | np.ndarray:
    """The weight as the backend stores it: transposed and zero-padded where the plan says (packed
    codes come as a uint32 numpy array: torch has no such dtype to hold them)."""
    plan = layouts.stored.get(name, StoredWeight())
    if plan.packed:
        return packed_codes(tensor, plan.packed)
    weight = tensor.t() if plan.transposed else tensor
    if plan.rows is not None:
        weight = torch.cat([weight, weight.new_zeros(plan.rows - weight.shape[0], *weight.shape[1:])])
    if plan.lanes:
        rows, in_features = weight.shape
        weight = weight.reshape(rows // plan.lanes, plan.lanes, in_features).transpose(1, 2)
    return weight.contiguous()
