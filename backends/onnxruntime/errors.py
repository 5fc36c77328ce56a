"""Errors of the ONNX Runtime backend: each names the problem and the fix."""

from __future__ import annotations

from kiln.backends.errors import FeedError, LoweringError  # noqa: F401  (re-exported: one class each)
from kiln.ir.errors import ArtifactError, KilnError, UnsupportedOpError  # noqa: F401  (re-exported)

OnnxLoweringError = LoweringError  # the name this backend's callers know; an IR graph it cannot write as ONNX


class ProviderError(KilnError):
    """The execution provider asked for is not installed, or cannot run an op of the model."""
