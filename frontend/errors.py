"""Errors the frontend raises: each names the problem and the fix."""

from __future__ import annotations

from kiln.ir.errors import KilnError  # noqa: F401  (re-exported)


class ModelNotFoundError(KilnError):
    """The model named by the user is not on this machine (Kiln never downloads one)."""


class CheckpointError(KilnError):
    """A checkpoint exists but Kiln cannot load it (missing config, pickled weights, ...)."""


class UnsupportedOpError(KilnError):
    """Capture met an ATen op that has no mapping to Kiln's IR.

    Attributes:
        op: the ATen op's name, e.g. ``aten.cumsum.default``.
        arg_shapes: shapes (or reprs) of its arguments, as captured.
        source_line: the user's source line that produced it (from the FX node's
            ``stack_trace``), or None when the trace has none.
    """

    def __init__(self, op: str, arg_shapes: list, source_line: str | None) -> None:
        self.op = op
        self.arg_shapes = list(arg_shapes)
        self.source_line = source_line
        shapes = ", ".join(str(shape) for shape in self.arg_shapes) or "none"
        where = source_line if source_line else "an unknown source line"
        super().__init__(
            f"Kiln does not support the ATen op `{op}` (argument shapes {shapes}) at {where}. "
            "Fix: rewrite that line with supported operations (matmul, elementwise math, "
            "softmax, norms, shape ops), or register a lowering for the op in Kiln's "
            "ATen-to-IR table."
        )
