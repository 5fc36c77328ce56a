"""Errors of the ONNX Runtime backend: each names the problem and the fix."""
from __future__ import annotations

from kiln.ir.errors import KilnError


class OnnxLoweringError(KilnError):
    """An IR graph cannot be written as ONNX (an op without a lowering, an unbound symbol, ...)."""


class ProviderError(KilnError):
    """The execution provider asked for is not installed, or cannot run an op of the model."""


class FeedError(KilnError, ValueError):
    """tokens/positions do not fit the executable (shape, batch, range, or positions not contiguous)."""
