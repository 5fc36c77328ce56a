"""Named weight-quantization schemes: `compile-model --quantize NAME` picks one.

A scheme says how many bits, how many input columns share a scale (None: the whole row, i.e.
per output channel), whether the grid is symmetric around zero or carries a zero point (an
integer one, or a fractional one stored like the scales: `float_zero`), the scales' dtype, and
the method: "rtn" rounds each weight to the nearest grid point; "fit" fits each group's scale and
offset to the weights (passes/fitted_rounding.py); "awq" first rescales input channels by the
activations seen on calibration text (passes/awq_scaling.py), then rounds; "awq-mixed" and
"fit-mixed" then keep the layers most sensitive to the 4-bit rounding at the `upgrade` scheme,
within `budget_bits` per weight (passes/mixed_precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.errors import KilnError


class UnknownSchemeError(KilnError, ValueError):
    """A quantization scheme name that is not in the registry."""


@dataclass(frozen=True)
class QuantScheme:
    name: str
    bits: int
    group_size: int | None  # None: one group per output row (per-channel)
    symmetric: bool
    method: str = "rtn"  # "rtn" | "fit" | "awq" | "awq-mixed" | "fit-mixed"
    summary: str = ""
    budget_bits: float | None = None  # mixed: stored bits per quantized weight, scales included
    scale_dtype: str = "f32"  # "f16": half the bytes per scale (llama.cpp's blocks store f16)
    float_zero: bool = False  # asymmetric with a fractional zero point (llama.cpp's Q4_1 `d * q + m`)
    upgrade: str = "int8"  # mixed: the scheme of the most sensitive layers
    importance: bool = False  # fit: weigh each column's error by its activations (llama.cpp's imatrix)

    @property
    def awq(self) -> bool:
        return self.method in ("awq", "awq-mixed")

    @property
    def mixed(self) -> bool:
        return self.method.endswith("-mixed")

    @property
    def fitted(self) -> bool:
        return self.method in ("fit", "fit-mixed")

    @property
    def needs_calibration(self) -> bool:
        return self.awq or self.mixed or self.importance

    def group_size_for(self, in_features: int) -> int:
        """The `group_size` attribute of a linear_q with `in_features` columns."""
        return in_features if self.group_size is None else self.group_size


def _int4_fit(group: int, importance: bool = False) -> QuantScheme:
    how = ", the error of each input column weighted by the mean square of its activations" if importance else ""
    return QuantScheme(
        f"int4-g{group}-fit" + ("-imatrix" if importance else ""),
        4,
        group,
        False,
        "fit",
        f"4-bit, groups of {group} inputs, asymmetric with a fractional zero point, f16 scales and "
        f"zero points, each group's scale and offset fitted to its weights{how}",
        scale_dtype="f16",
        float_zero=True,
        importance=importance,
    )


def _int4(group: int, symmetric: bool, method: str = "rtn") -> QuantScheme:
    suffix = ("" if symmetric else "-asym") + ("-awq" if method == "awq" else "")
    how = "activation-aware scaling, then round-to-nearest" if method == "awq" else "round-to-nearest"
    grid = "symmetric (zero point 8)" if symmetric else "asymmetric (a zero point per group)"
    return QuantScheme(
        f"int4-g{group}{suffix}", 4, group, symmetric, method, f"4-bit, groups of {group} inputs, {grid}, {how}"
    )


INT8_G32 = QuantScheme(
    "int8-g32", 8, 32, True, "rtn", "8-bit, groups of 32 inputs, symmetric, f16 scales (llama.cpp's Q8_0 grid), "
    "round-to-nearest", scale_dtype="f16"
)  # fmt: skip
INT4_MIXED = QuantScheme(
    "int4-mixed", 4, 32, True, "awq-mixed", "int4-g32-awq, with the layers most sensitive to it at int8 while the "
    "weights average at most 5.5 bits (scales included)", budget_bits=5.5
)  # fmt: skip
INT4_FIT_MIXED = QuantScheme(
    "int4-fit-mixed", 4, 32, False, "fit-mixed", "int4-g32-fit, with the layers most sensitive to it (the lm_head "
    "and embedding table too, when quantized) at int8-g32 while the weights average at most 6 bits (scales "
    "included)", budget_bits=6.0, scale_dtype="f16", float_zero=True, upgrade="int8-g32"
)  # fmt: skip

SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in [
        QuantScheme("int8", 8, None, True, "rtn", "8-bit, per output channel, symmetric, round-to-nearest"),
        *(_int4(g, symmetric) for symmetric in (True, False) for g in (32, 64, 128)),
        *(_int4(g, symmetric, "awq") for symmetric in (True, False) for g in (32, 64, 128)),
        INT8_G32,
        *(_int4_fit(g) for g in (32, 64, 128)),
        *(_int4_fit(g, importance=True) for g in (32, 64, 128)),
        INT4_MIXED,
        INT4_FIT_MIXED,
    ]
}


def get_scheme(name: str) -> QuantScheme:
    """The scheme called `name`; an unknown name is an error listing the known ones."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise UnknownSchemeError(
            f"unknown quantization scheme {name!r}; known schemes: {', '.join(SCHEMES)} "
            "(or none). Fix: pick one of those (--quantize SCHEME)."
        ) from None


def scheme_names() -> list[str]:
    """Every scheme name, in registry order (for --quantize's choices)."""
    return list(SCHEMES)
