"""A lowering choice an AOTInductor package records, so that its load lowers the same way.

A package names the constants of the ops it was compiled with (e.g. an 8-bit linear's packed
codes, an fp32 weight's panels); a load rebuilds those constants by lowering the graph again, so it
must pick what the package picked, whatever this host or the environment would pick now.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager


class PackagedChoice:
    """One such choice: None outside `lowering_as` (the lowering decides), else the package's."""

    def __init__(self, name: str):
        self._chosen: contextvars.ContextVar[str | None] = contextvars.ContextVar(name, default=None)

    def get(self) -> str | None:
        return self._chosen.get()

    @contextmanager
    def lowering_as(self, choice: str | None):
        token = self._chosen.set(choice)
        try:
            yield
        finally:
            self._chosen.reset(token)
