"""Errors every backend raises: each names the problem and the fix."""

from __future__ import annotations

from kiln.ir.errors import KilnError


class LoweringError(KilnError, ValueError):
    """A graph cannot be lowered as given: an unbound symbol, a dim the backend cannot express,
    a misused cache input, a weight a kernel cannot take, ..."""


class FeedError(KilnError, ValueError):
    """tokens/positions (or an output buffer) given to `Executable.run` do not fit the executable:
    shape, batch, range, or positions a backend needs consecutive."""
