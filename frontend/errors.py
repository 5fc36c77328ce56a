"""Errors the frontend raises: each names the problem and the fix."""

from __future__ import annotations

from kiln.ir.errors import KilnError, UnsupportedOpError  # noqa: F401  (re-exported)


class ModelNotFoundError(KilnError):
    """The model named by the user is not on this machine (Kiln never downloads one)."""


class CheckpointError(KilnError):
    """A checkpoint exists but Kiln cannot load it (missing config, pickled weights, ...)."""
