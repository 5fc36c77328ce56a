"""The root of Kiln's error tree, and the kinds of failure more than one stage raises.

`KilnError` lives in `kiln.ir`, the one stage every other imports, so that the dependency
arrows stay one-way (runtime -> backends -> passes -> ir <- frontend). Every error Kiln raises
is a `KilnError`, one class per kind of failure, and its message names the problem and the fix.
Classes that also derive from a builtin (ValueError, RuntimeError, NotImplementedError) keep
code that catches the builtin working. README.md ("Errors") lists the whole tree.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error Kiln raises on purpose; catch this to catch them all."""


class ArtifactError(KilnError):
    """An artifact directory, or a file of it, is missing, foreign, too new, truncated or damaged
    (its backend's own files included)."""


class OptionError(KilnError, ValueError):
    """An option has a value Kiln cannot use: an argument of `kiln.compile`, a command-line flag,
    or a KILN_* environment switch."""


class UnsupportedOpError(KilnError, NotImplementedError):
    """An op a stage cannot translate: an ATen op capture has no IR mapping for, or an IR op a
    backend has no lowering for.

    Attributes:
        op: the op's name (``aten.cumsum.default``, ``rms_norm``), or None when the message
            names several.
        arg_shapes: shapes (or reprs) of its arguments, as captured ([] from a backend).
        source_line: the user's source line that produced it (from the FX node's
            ``stack_trace``), or None when unknown.
    """

    def __init__(self, message: str, op: str | None = None, arg_shapes=(), source_line: str | None = None) -> None:
        self.op = op
        self.arg_shapes = list(arg_shapes)
        self.source_line = source_line
        super().__init__(message)

    @classmethod
    def in_capture(cls, op: str, arg_shapes: list, source_line: str | None) -> UnsupportedOpError:
        """The error for an ATen op that capture has no IR mapping for."""
        shapes = ", ".join(str(shape) for shape in arg_shapes) or "none"
        where = source_line if source_line else "an unknown source line"
        return cls(
            f"Kiln does not support the ATen op `{op}` (argument shapes {shapes}) at {where}. "
            "Fix: rewrite that line with supported operations (matmul, elementwise math, "
            "softmax, norms, shape ops), or register a lowering for the op in Kiln's "
            "ATen-to-IR table.",
            op,
            arg_shapes,
            source_line,
        )
