"""`linear_q` -> MatMulNBits, `embedding_q` -> GatherBlockQuantized (com.microsoft), and
`gathered_matmul_q` (quantized MoE experts) -> GatherBlockQuantized of the routed experts + MatMul.

The IR's quantized weight (see ir/ops/quantized.py): q [N, K] in groups of `group_size` along K,
W = (q - z) * scale per group; 4-bit q packed two per byte, element 2j in the low nibble; 8-bit q
signed and symmetric. ORT's kernels want blocks of a power of two >= 16 along K, unsigned codes
and packed zero points, so the weight is re-laid once at lowering:
- block = the largest power of two in 16..256 dividing group_size (an IR group is group_size / block
  ORT blocks sharing its scale and zero point); no such block: the weight is dequantized at
  lowering and runs as a float MatMul / Gather;
- 8-bit codes shift to unsigned (q + 128 against ORT's default zero point 128); 4-bit codes
  keep ORT's default zero point 8, the IR's symmetric one;
- f16 scales become f32 (MatMulNBits wants x's type); fractional zero points (float `zeros`)
  go to MatMulNBits as f32, which then computes in f32 whatever the accuracy level, and make
  `embedding_q` a Gather over the table dequantized here (GatherBlockQuantized takes integer
  zero points only).
MatMulNBits runs at accuracy level 4 by default (activations rounded to int8 per block for an
integer dot product: ORT's fast CPU path); `KILN_ORT_ACCURACY_LEVEL=0` keeps them f32 (the IR's
exact result, slower), read when the lowering module is imported and written into each node.
"""

from __future__ import annotations

import os

import numpy as np

from kiln.ir import Node

from .onnx_builder import MS_DOMAIN, OnnxBuilder

DEFAULT_ZERO = {4: 8, 8: 128}  # ORT's zero point when none is given, in ORT's unsigned codes
# MatMulNBits' accuracy_level: 4 quantizes activations to int8 per block (faster on CPUs with int8
# dot products; what genai's builder picks for CPU int4, and what Kiln's Inductor int4 decode
# kernel does); 0 computes in f32 (the IR's exact result). CUDA ignores it.
ACCURACY_LEVEL = int(os.environ.get("KILN_ORT_ACCURACY_LEVEL", "4"))


MAX_BLOCK = 256  # MatMulNBits takes blocks of 16, 32, 64, 128 or 256


def ort_block_size(group_size: int) -> int | None:
    """The largest power of two in 16..MAX_BLOCK dividing group_size, else None (per-channel int8
    of K = 1536 is 6 blocks of 256 sharing one scale)."""
    block = 16
    if group_size % block:
        return None
    while block < MAX_BLOCK and group_size % (block * 2) == 0:
        block *= 2
    return block


def unsigned_codes(qweight: np.ndarray, bits: int) -> np.ndarray:
    """u8 [N, K] codes 0..2^bits-1 in ORT's convention (zero point 8 or 128)."""
    if bits == 4:
        return np.stack((qweight & 0x0F, qweight >> 4), axis=-1).reshape(qweight.shape[0], -1).astype(np.uint8)
    return (qweight.astype(np.int16) + 128).astype(np.uint8)


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """u8 [..., 2m] of 0..15 -> u8 [..., m], element 2j in the low nibble."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def dequantized(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int, group_size: int):
    """The f32 [N, K] weight (for group sizes ORT's kernels do not take)."""
    codes = unsigned_codes(qweight, bits).astype(np.float32)
    k = codes.shape[1]
    zero = (
        np.float32(DEFAULT_ZERO[bits])
        if zeros is None
        else np.repeat(zeros.astype(np.float32), group_size, axis=1)[:, :k]
    )
    return ((codes - zero) * np.repeat(scales, group_size, axis=1)[:, :k]).astype(np.float32)


def _blocked(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int, group_size: int, block: int):
    """(codes [N, blocks, block], scales [N, blocks], zeros [N, blocks] or None) in ORT blocks."""
    codes = unsigned_codes(q, bits)
    n, k = codes.shape
    blocks = -(-k // block)
    padded = np.full((n, blocks * block), DEFAULT_ZERO[bits], np.uint8)
    padded[:, :k] = codes
    repeat = group_size // block
    block_scales = np.repeat(scales, repeat, axis=1)[:, :blocks]
    block_zeros = None if zeros is None else np.repeat(zeros, repeat, axis=1)[:, :blocks]
    return padded.reshape(n, blocks, block), np.ascontiguousarray(block_scales), block_zeros


def float_parts(scales: np.ndarray, zeros: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales as f32, and float (fractional) zero points as f32; integer zero points kept u8."""
    if zeros is not None and zeros.dtype != np.uint8:
        zeros = zeros.astype(np.float32)
    return scales.astype(np.float32), zeros


def lower_linear_q(b: OnnxBuilder, node: Node) -> str:
    x, qweight, scales, zeros, bias = node.inputs
    weight = [b.weight(qweight), b.weight(scales), None if zeros is None else b.weight(zeros)]
    out = matmul_nbits(b, b.value(x), *weight, b.value(bias) if bias is not None else "", node.attrs, qweight.name)
    b.declare(out, node.output.type.dtype, node.output.type.shape)
    return out


def matmul_nbits(
    b: OnnxBuilder,
    x: str,
    q: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None,
    bias: str,
    attrs: dict,
    name: str,
) -> str:
    """x @ W.T (+ bias) for the quantized W = (q, scales, zeros): MatMulNBits, or a float MatMul
    over W dequantized here when the group size makes no ORT block."""
    bits, group_size = attrs["bits"], attrs["group_size"]
    block = ort_block_size(group_size)
    scales, zeros = float_parts(scales, zeros)
    if block is None:
        w = dequantized(q, scales, zeros, bits, group_size)
        y = b.op("MatMul", x, b.initializer(f"{name}.dequantized.T", np.ascontiguousarray(w.T)))
        return b.op("Add", y, bias) if bias else y
    codes, block_scales, block_zeros = _blocked(q, scales, zeros, bits, group_size, block)
    n, blocks, _ = codes.shape
    inputs = [
        x,
        b.initializer(f"{name}.nbits", pack_nibbles(codes) if bits == 4 else codes),
        b.initializer(f"{name}.nbits_scales", block_scales),
    ]
    if block_zeros is not None and block_zeros.dtype != np.uint8:
        inputs.append(b.initializer(f"{name}.nbits_zeros", np.ascontiguousarray(block_zeros)))
    elif block_zeros is not None:
        even = np.full((n, blocks + blocks % 2), DEFAULT_ZERO[4], np.uint8)
        even[:, :blocks] = block_zeros
        inputs.append(b.initializer(f"{name}.nbits_zeros", pack_nibbles(even)))
    else:
        inputs.append("")
    return b.op(
        "MatMulNBits",
        *inputs,
        "",
        bias,
        domain=MS_DOMAIN,
        K=qweight_in(q, bits),
        N=int(n),
        bits=bits,
        block_size=block,
        accuracy_level=ACCURACY_LEVEL,
    )


def qweight_in(q: np.ndarray, bits: int) -> int:
    """K from a qweight (two 4-bit codes per byte)."""
    return q.shape[1] * 2 if bits == 4 else q.shape[1]


def _gather_block_tables(q, scales, zeros, bits: int, group_size: int, block: int):
    """GatherBlockQuantized's data, scales and zero points for the rows of q [n, ...] in ORT blocks
    along K: 4-bit codes and zero points two per byte (zero points padded to an even count)."""
    codes, block_scales, block_zeros = _blocked(q, scales, zeros, bits, group_size, block)
    n = codes.shape[0]
    data = pack_nibbles(codes.reshape(n, -1)) if bits == 4 else codes.reshape(n, -1)
    if block_zeros is not None:
        even = np.full((n, block_zeros.shape[1] + block_zeros.shape[1] % 2), DEFAULT_ZERO[4], np.uint8)
        even[:, : block_zeros.shape[1]] = block_zeros
        block_zeros = pack_nibbles(even)
    return data, block_scales, block_zeros


def lower_embedding_q(b: OnnxBuilder, node: Node) -> str:
    qweight, scales, ids, zeros = node.inputs
    bits, group_size = node.attrs["bits"], node.attrs["group_size"]
    block = ort_block_size(group_size)
    q = b.weight(qweight)
    float_scales, zero_points = float_parts(b.weight(scales), None if zeros is None else b.weight(zeros))
    fractional = zero_points is not None and zero_points.dtype != np.uint8
    if block is None or q is None or qweight_in(q, bits) % block or fractional:
        w = dequantized(q, float_scales, zero_points, bits, group_size)
        return b.op("Gather", b.initializer(f"{qweight.name}.dequantized", w), b.value(ids), axis=0)
    data, block_scales, block_zeros = _gather_block_tables(q, float_scales, zero_points, bits, group_size, block)
    inputs = [
        b.initializer(f"{qweight.name}.gather", data),
        b.value(ids),
        b.initializer(f"{scales.name}.gather", block_scales),
    ]
    if block_zeros is not None:
        inputs.append(b.initializer(f"{zeros.name}.gather", block_zeros))
    out = b.op(
        "GatherBlockQuantized", *inputs, domain=MS_DOMAIN, bits=bits, block_size=block, gather_axis=0, quantize_axis=1
    )
    b.declare(out, node.output.type.dtype, node.output.type.shape)
    return out


def lower_gathered_matmul_q(b: OnnxBuilder, node: Node) -> str:
    """Quantized MoE experts (`gathered_matmul_q`): the routed experts' codes gathered and
    dequantized (GatherBlockQuantized where ORT's blocks fit, else Gather + dequantizing ops), then
    one MatMul per row: only the routed experts' codes are read."""
    qweight, scales, _, x, zeros = node.inputs
    bits, group_size = node.attrs["bits"], node.attrs["group_size"]
    q = b.weight(qweight)
    float_scales, zero_points = float_parts(b.weight(scales), None if zeros is None else b.weight(zeros))
    block = ort_block_size(group_size)
    fractional = zero_points is not None and zero_points.dtype != np.uint8
    if block is None or qweight_in(q[0], bits) % block or fractional:
        weights = _gathered_dequantized(b, node, q, float_scales, zero_points)
    else:
        weights = _gathered_blocks(b, node, q, float_scales, zero_points, block)
    out = b.op("MatMul", weights, b.value(x))
    b.declare(out, node.output.type.dtype, node.output.type.shape)
    return out


def _stacked(a: np.ndarray | None, experts: int) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a.reshape(experts, -1, *a.shape[1:]))


def _gathered_blocks(b, node, q, scales, zeros, block) -> str:
    """GatherBlockQuantized over the experts' codes in ORT blocks along K (gather axis 0)."""
    qweight, scales_value, ids, _, zeros_value = node.inputs
    bits, group_size = node.attrs["bits"], node.attrs["group_size"]
    experts, out = q.shape[:2]
    flat = [None if a is None else a.reshape(experts * out, -1) for a in (q, scales, zeros)]
    data, block_scales, block_zeros = _gather_block_tables(*flat, bits, group_size, block)
    inputs = [
        b.initializer(f"{qweight.name}.gather", _stacked(data, experts)),
        b.value(ids),
        b.initializer(f"{scales_value.name}.gather", _stacked(block_scales, experts)),
    ]
    if block_zeros is not None:
        inputs.append(b.initializer(f"{zeros_value.name}.gather", _stacked(block_zeros, experts)))
    return b.op(
        "GatherBlockQuantized", *inputs, domain=MS_DOMAIN, bits=bits, block_size=block, gather_axis=0, quantize_axis=2
    )


def _gathered_dequantized(b, node, q, scales, zeros) -> str:
    """(codes - zero) * scale over the gathered experts in ONNX ops, for group sizes or fractional
    zero points GatherBlockQuantized does not take: 4-bit codes stay packed until gathered."""
    qweight, scales_value, ids, _, zeros_value = node.inputs
    bits, group_size = node.attrs["bits"], node.attrs["group_size"]
    k = qweight_in(q[0], bits)
    routed = b.value(ids)
    data = q if bits == 4 else unsigned_codes(q.reshape(-1, k), 8).reshape(q.shape)
    codes = b.op("Gather", b.initializer(f"{qweight.name}.codes", data), routed, axis=0)
    if bits == 4:
        low = b.op("BitwiseAnd", codes, b.const(np.uint8(0x0F), np.uint8))
        high = b.op("BitShift", codes, b.const(np.uint8(4), np.uint8), direction="RIGHT")
        pairs = b.op("Concat", b.op("Unsqueeze", low, b.const([-1])), b.op("Unsqueeze", high, b.const([-1])), axis=-1)
        codes = b.op("Reshape", pairs, b.const([0, 0, -1]))
    columns = b.const(np.arange(k) // group_size)  # each column's group

    def per_column(table: str) -> str:
        return b.op("Gather", b.op("Gather", table, routed, axis=0), columns, axis=2)

    zero = (
        b.const(np.float32(DEFAULT_ZERO[bits]), np.float32)
        if zeros is None
        else per_column(b.initializer(f"{zeros_value.name}.f32", zeros.astype(np.float32)))
    )
    centered = b.op("Sub", b.cast(codes, "u8", "f32"), zero)
    return b.op("Mul", centered, per_column(b.initializer(f"{scales_value.name}.f32", scales)))
