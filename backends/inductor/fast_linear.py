"""Route fp32 `linear` nodes to Kiln's linear kernel (`torch.ops.kiln.linear_f32_panels`, gemv_kernel.py).

Why: decode is one GEMV per weight per token, and Inductor leaves every linear as an extern MKL
call whose fp32 GEMV streams weights well below this machine's bandwidth; Kiln's kernel streams
them near it, and over several rows of x (verification, batched decode, prefill) it multiplies
while it streams, so 8 tokens cost about 1.2 one. The op is a torch custom op with a fake
implementation, so torch.compile and AOTInductor call it like any extern kernel (AOTI through its
proxy executor).

The lowering packs each weight once, at lowering time (`pack_linear_weight(w, "panels")`: W.t()
cut into panels of 32 or 64 columns, each one sequential stream); the artifact keeps the original
[N, K] weight and a load packs again, in the layout its package was compiled with
(`lowering_f32_as`: artifacts from before the panels call `linear_f32` over the slab layout).
`KILN_LINEAR_LAYOUT=slabs` lowers to that older kernel (for comparisons). It declines (F.linear
stays) when the weight is not an fp32 parameter, when the CPU lacks AVX2/FMA or no C++ compiler
can build the kernel (with a warning naming why), or when `KILN_LINEAR_KERNEL=torch` asks for
torch's own linear.
"""

from __future__ import annotations

import functools
import os

import torch

from kiln.ir.errors import OptionError

from . import gemv_kernel
from .lower_to_fx import register_linear_lowering
from .packaged_choice import PackagedChoice

ENV_SWITCH = "KILN_LINEAR_KERNEL"  # "kiln" (default) or "torch"
LAYOUT_SWITCH = "KILN_LINEAR_LAYOUT"  # "panels" (default) or "slabs" (the kn kernels, for comparisons)


@functools.cache
def kernel_available() -> bool:
    """Whether the GEMV kernel is built and loaded here (it builds once, then it is cached)."""
    return gemv_kernel.kernel_loads(
        gemv_kernel.ensure_loaded, "Kiln's GEMV kernel is unavailable, linears run on torch's F.linear (slower decode)"
    )


def wanted() -> bool:
    return gemv_kernel.kernel_chosen(ENV_SWITCH, "Kiln's GEMV kernel", "F.linear")


_packaged_layout = PackagedChoice("kiln_f32_layout")


def lowering_f32_as(layout_name: str | None):
    """Lower fp32 linears in `layout_name` ("panels" or "slabs") whatever the switch says: an
    AOTInductor package names the constants of the layout it was compiled with, so its load (or an
    artifact's from before the panels, "slabs") must build the same ones."""
    return _packaged_layout.lowering_as(layout_name)


def f32_layout_of(module: torch.fx.GraphModule) -> str:
    """Which fp32 layout a lowered module's linears use ("panels" or "slabs"), for a package to record."""
    return "panels" if any("linear_f32_panels" in str(n.target) for n in module.graph.nodes) else "slabs"


def layout() -> str:
    packaged = _packaged_layout.get()
    if packaged is not None:
        return packaged
    choice = os.environ.get(LAYOUT_SWITCH, "panels").lower()
    if choice not in ("panels", "slabs"):
        raise OptionError(
            f"{LAYOUT_SWITCH}={choice!r} is not a choice. Fix: set it to 'panels' (the default) or "
            "'slabs', or unset it."
        )
    return choice


def lower_linear_f32(b, node, args, attrs):
    """`linear(x, W, bias?)` -> `kiln.linear_f32_panels(x, W in panels, width, bias)` for an fp32
    weight parameter (`kiln.linear_f32(x, W.t(), bias)` with KILN_LINEAR_LAYOUT=slabs)."""
    weight = b.constant(args[1])
    x_type = node.inputs[0].type
    if not b.on_cpu or weight is None or weight.dim() != 2 or weight.dtype != torch.float32 or x_type.dtype != "f32":
        return None
    if not wanted() or not kernel_available():
        return None
    if layout() == "slabs":
        packed = b.add_constant(node.inputs[1].name + ".packed", gemv_kernel.pack_linear_weight(weight))
        return b.call(torch.ops.kiln.linear_f32, args[0], packed, args[2])
    panels = b.add_constant(node.inputs[1].name + ".panels", gemv_kernel.pack_linear_weight(weight, "panels"))
    width = gemv_kernel.panel_width(weight.shape[0])
    return b.call(torch.ops.kiln.linear_f32_panels, args[0], panels, width, args[2])


register_linear_lowering(lower_linear_f32)
