"""Inductor lowerings of the quantized-weight ops `linear_q` and `embedding_q` (ir/ops/quantized.py).

- 8-bit per output channel, K % 32 == 0, on CPUs with AVX-512 VNNI -> `torch.ops.kiln.linear_q8`
  (int8_kernel.py): x rounded to int8 per block of 32 (as llama.cpp's Q8_0), integer dot products,
  the weight repacked once at lowering into 16-channel panels; a SmolLM2-135M int8 step over 8
  tokens costs 1.7x one token instead of 3.0-3.3x with f32 FMAs (bench/step_cost.py, 2 threads).
  Other K, AVX2-only CPUs (where linear_q8's AVX2 path is slower at decode) or no int8 kernel ->
  `torch.ops.kiln.linear_i8` (gemv_kernel.py: f32 activations, the int8 weight repacked to
  [K, N]), with its [N] scales.
- 4-bit, K % 64 == 0 and group_size 32 or a multiple of 64 -> `torch.ops.kiln.linear_q4_panels`
  (int4_kernel.py): decode reads the IR's packed u8 [N, K/2] weight, scales and zero points as
  they are (symmetric weights: an f16 copy of the scales made at lowering, as llama.cpp's Q4_0
  stores them: 4.5 instead of 5 bits read per weight, each scale within 2^-11 of the f32 one);
  2..128 rows of x read a copy packed at lowering into panels of 16 rows (`pack_panels`), which
  spares each call the staging of the weights (SmolLM2's int4-g32 linears over 8 rows: 0.8x the
  time, bench/int4_rows.py --panels). Weights that are not module constants run linear_q4.
- anything else (8-bit groups smaller than the row such as int8-g32, fractional zero points,
  other group sizes, no AVX2/compiler, or KILN_LINEAR_KERNEL=torch) -> dequantize + F.linear in
  torch ops, which Inductor compiles like the rest of the graph. f16 scales in the IR are copied
  to f32 for the kernels at lowering.
- `embedding_q` gathers the rows first, then dequantizes only those.
PyTorch's own CPU kernels (`aten._weight_int4pack_mm_for_cpu`, `aten._weight_int8pack_mm`) were
measured 7-12 times slower than the fp32 GEMV here, so they are not used (see int4_kernel.py).
All these run under AOTInductor too: the custom ops through its proxy executor, the repacked
weight as a module constant that `load` rebuilds from the artifact's weights.
"""

from __future__ import annotations

import functools
import os

import torch

from kiln.ir.errors import OptionError
from kiln.ir.ops.quantized import embedding_q_reference, linear_q_reference

from .packaged_choice import PackagedChoice

INT8_ENV_SWITCH = "KILN_INT8_KERNEL"  # "q8" (default) or "i8"


@functools.cache
def int4_kernel_available() -> bool:
    """Whether Kiln's int4 kernel is built and loaded here (built once, then cached)."""
    from . import gemv_kernel, int4_kernel

    return gemv_kernel.kernel_loads(
        int4_kernel.ensure_loaded, "Kiln's int4 kernel is unavailable; 4-bit linears dequantize in torch ops (slower)"
    )


@functools.cache
def int8_kernel_available() -> bool:
    """Whether Kiln's int8 x int8 kernel is built and loaded here (built once, then cached)."""
    from . import gemv_kernel, int8_kernel

    loads = gemv_kernel.kernel_loads(
        int8_kernel.ensure_loaded,
        "Kiln's int8 x int8 kernel is unavailable; 8-bit linears use f32 activations (slower over several tokens)",
    )
    return loads and int8_kernel.faster_than_f32_activations()


def _int8_activations_wanted() -> bool:
    """KILN_INT8_KERNEL=q8 (default: linear_q8) or i8 (linear_i8, f32 activations: to compare, or to
    load an artifact compiled before linear_q8, whose package names the [K, N] constants)."""
    choice = os.environ.get(INT8_ENV_SWITCH, "q8").lower()
    if choice not in ("q8", "i8"):
        raise OptionError(
            f"{INT8_ENV_SWITCH}={choice!r} is not a choice. Fix: set it to 'q8' (int8 x int8) or 'i8' "
            "(f32 activations), or unset it."
        )
    return choice == "q8"


_packaged_int8_form = PackagedChoice("kiln_int8_form")


def lowering_int8_as(form: str | None):
    """Lower 8-bit linears as `form` ("q8": linear_q8, "i8": linear_i8) whatever this CPU would
    pick: an AOTInductor package names the constants of the form it was compiled with, so a load
    on another host (or of an artifact older than linear_q8, "i8") must build the same ones."""
    return _packaged_int8_form.lowering_as(form)


def int8_form_of(module: torch.fx.GraphModule) -> str:
    """Which 8-bit linear op a lowered module calls ("q8" or "i8"), for a package to record."""
    return "q8" if any("linear_q8" in str(n.target) for n in module.graph.nodes) else "i8"


def _int8_form_here(in_features: int) -> str:
    from . import int8_kernel

    packaged = _packaged_int8_form.get()
    if packaged == "q8":
        int8_kernel.ensure_loaded()  # the AVX2 form runs where VNNI does not
        return "q8"
    if (
        packaged is None
        and int8_kernel.supports(in_features)
        and _int8_activations_wanted()
        and int8_kernel_available()
    ):
        return "q8"
    return "i8"


def _kernels_wanted() -> bool:
    from .fast_linear import wanted

    return wanted()


def int8_packed(qweight: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(form, codes as that kernel reads them) for int8 codes [N, K], or stacked experts [E, N, K]
    each alike: "q8", linear_q8's panels, or "kn", linear_i8's [K, N]."""
    if _int8_form_here(qweight.shape[-1]) == "q8":
        from . import int8_kernel

        pack = int8_kernel.pack_int8_weight
        return "q8", pack(qweight) if qweight.dim() == 2 else torch.stack([pack(e) for e in qweight])
    return "kn", qweight.transpose(-1, -2).contiguous()


def int4_kernel_scales(b, k, group_size: int, scales_arg, scales_name: str, zeros_arg):
    """(f32 scales, f16 decode scales or None) for Kiln's int4 kernel, or None where it does not
    apply (K not a multiple of 64, a group size it lacks, fractional zero points)."""
    if not isinstance(k, int) or k % 64 or (group_size != 32 and group_size % 64) or not int4_kernel_available():
        return None
    scales, decode_scales = b.constant(scales_arg), None
    zeros = None if zeros_arg is None else b.constant(zeros_arg)
    if zeros is not None and zeros.dtype != torch.uint8:
        return None  # fractional zero points: the kernel folds integer ones only
    f32_scales = scales_arg
    if scales is not None and scales.dtype != torch.float32:  # f16 in the IR: the kernel's f32 copy
        f32_scales = b.add_constant(scales_name + ".f32", scales.float().contiguous())
    if zeros_arg is None and scales is not None:  # symmetric: decode reads f16 scales
        decode_scales = (
            scales_arg
            if scales.dtype == torch.float16
            else b.add_constant(scales_name + ".f16", scales.to(torch.float16).contiguous())
        )
    return f32_scales, decode_scales


def _int8_kernel(b, node, args, attrs):
    from .fast_linear import kernel_available

    qweight, scales = b.constant(args[1]), b.constant(args[2])
    if qweight is None or scales is None or attrs["group_size"] != qweight.shape[1] or not kernel_available():
        return None
    flat_scales = b.add_constant(node.inputs[2].name + ".flat", scales.reshape(-1).float().contiguous())
    form, packed = int8_packed(qweight)
    packed = b.add_constant(f"{node.inputs[1].name}.{form}", packed)
    kernel = torch.ops.kiln.linear_q8 if form == "q8" else torch.ops.kiln.linear_i8
    return b.call(kernel, args[0], packed, flat_scales, args[4])


def _int4_panels(b, node, args, f32_scales, group_size: int):
    """The weight packed into panels of 16 rows (int4_kernel.pack_panels) as a module constant, or
    None where its codes, scales or zero points are not constants."""
    from .int4_kernel import pack_panels

    qweight, scales = b.constant(args[1]), b.constant(f32_scales)
    zeros = None if args[3] is None else b.constant(args[3])
    if qweight is None or scales is None or (args[3] is not None and zeros is None):
        return None
    return b.add_constant(node.inputs[1].name + ".panels", pack_panels(qweight, scales, zeros, group_size))


def _int4_kernel(b, node, args, attrs):
    k, group_size = node.inputs[0].type.shape[-1], attrs["group_size"]
    prepared = int4_kernel_scales(b, k, group_size, args[2], node.inputs[2].name, args[3])
    if prepared is None:
        return None
    f32_scales, decode_scales = prepared
    panels = _int4_panels(b, node, args, f32_scales, group_size)
    if panels is None:
        return b.call(torch.ops.kiln.linear_q4, args[0], args[1], f32_scales, *args[3:5], group_size, decode_scales)
    return b.call(
        torch.ops.kiln.linear_q4_panels, args[0], panels, args[1], f32_scales, *args[3:5], group_size, decode_scales
    )


def lower_linear_q(b, node, args, attrs):
    """`linear_q` -> Kiln's int8/int4 kernel where it applies (on a GPU, its CUDA form:
    cuda_lowerings.py), else dequantize + F.linear."""
    if not b.on_cpu:
        from .cuda_lowerings import lower_linear_q_cuda

        result = lower_linear_q_cuda(b, node, args, attrs)
        if result is not None:
            return result
    elif _kernels_wanted():
        result = (_int8_kernel if attrs["bits"] == 8 else _int4_kernel)(b, node, args, attrs)
        if result is not None:
            return result
    return b.call(linear_q_reference, *args, bits=attrs["bits"], group_size=attrs["group_size"])


def lower_embedding_q(b, node, args, attrs):
    """`embedding_q` -> gather the rows, dequantize them."""
    bits, group_size, dtype = attrs["bits"], attrs["group_size"], attrs.get("dtype", "f32")
    return b.call(embedding_q_reference, *args, bits=bits, group_size=group_size, dtype=dtype)


QUANTIZED_LOWERINGS = {"linear_q": lower_linear_q, "embedding_q": lower_embedding_q}
