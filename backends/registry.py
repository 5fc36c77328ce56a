"""Which module implements each backend name.

A backend module provides `NAME`, `backend_version() -> str`, `lower(graph, options) ->
Executable` and `load(directory, graph, weights, options) -> Executable`. Modules are imported
only when asked for, so a backend with heavy or missing dependencies costs nothing unless used.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from kiln.ir.errors import KilnError

BACKENDS: dict[str, str] = {
    "reference": "kiln.backends.reference",
    "inductor": "kiln.backends.inductor",
    "onnxruntime": "kiln.backends.onnxruntime",
    "tinygrad": "kiln.backends.tinygrad",
}


class BackendNotFoundError(KilnError):
    """A backend name has no implementation in this installation."""


def get_backend(name: str) -> ModuleType:
    """The module implementing backend `name`; a clear error for unknown or unusable backends."""
    if name not in BACKENDS:
        raise BackendNotFoundError(
            f"Unknown backend {name!r}. Fix: use one of {', '.join(sorted(BACKENDS))}.")
    try:
        module = importlib.import_module(BACKENDS[name])
    except ImportError as e:
        raise BackendNotFoundError(
            f"The {name!r} backend cannot be imported ({e}). Fix: install its dependencies, "
            "or pick another backend, e.g. 'reference'.") from e
    missing = [f for f in ("lower", "load") if not hasattr(module, f)]
    if missing:
        raise BackendNotFoundError(
            f"The {name!r} backend ({BACKENDS[name]}) does not provide {', '.join(missing)} yet. "
            "Fix: pick another backend, e.g. 'reference'.")
    return module


def backend_version(module: ModuleType) -> str:
    """The backend's own version string, or torch's when the module does not say."""
    if hasattr(module, "backend_version"):
        return str(module.backend_version())
    import torch

    return torch.__version__
