"""Which module implements each backend name.

A backend module satisfies `kiln.backends.executable.Backend`: `NAME`, `backend_version() ->
str`, `lower(graph, options) -> Executable` and `load(directory, graph, weights, options) ->
Executable`. Modules are imported only when asked for, so a backend with heavy or missing
dependencies costs nothing unless used.
"""

from __future__ import annotations

import importlib

from kiln.ir.errors import KilnError

from .executable import Backend

BACKENDS: dict[str, str] = {
    "reference": "kiln.backends.reference",
    "inductor": "kiln.backends.inductor",
    "onnxruntime": "kiln.backends.onnxruntime",
    "tinygrad": "kiln.backends.tinygrad",
}

BACKEND_MEMBERS = ("NAME", "backend_version", "lower", "load")  # what Backend declares


class BackendNotFoundError(KilnError):
    """A backend name has no implementation in this installation."""


def get_backend(name: str) -> Backend:
    """The module implementing backend `name`; a clear error for unknown or unusable backends."""
    if name not in BACKENDS:
        raise BackendNotFoundError(f"Unknown backend {name!r}. Fix: use one of {', '.join(sorted(BACKENDS))}.")
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as e:
        raise BackendNotFoundError(
            f"The {name!r} backend cannot be imported ({e}). Fix: install its dependencies, "
            "or pick another backend, e.g. 'reference'."
        ) from e
    missing = [f for f in BACKEND_MEMBERS if not hasattr(module, f)]
    if missing:
        raise BackendNotFoundError(
            f"The {name!r} backend ({BACKENDS[name]}) does not provide {', '.join(missing)} yet. "
            "Fix: pick another backend, e.g. 'reference'."
        )
    return module


def backend_version(module: Backend) -> str:
    """The backend's own version string."""
    return str(module.backend_version())
