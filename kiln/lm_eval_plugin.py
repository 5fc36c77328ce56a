"""Registers Kiln's model with lm-evaluation-harness, so `lm_eval --model kiln` finds it.

lm-eval (0.4.13) looks models up only in its own registry, which `lm_eval.models` fills from a
fixed table; it has no entry-point discovery. So Kiln registers itself:

  - `install()` adds an import hook that registers `kiln` right after `lm_eval.models` runs (the
    registry must be filled by lm-eval first: an empty registry is what makes lm-eval import its
    table). The one-line startup file kiln_lm_eval.pth (`import kiln.lm_eval_plugin as
    _kiln_lm_eval; _kiln_lm_eval.install()`), placed in site-packages, runs it in every
    interpreter; it imports nothing else.
  - `register()` does it at once, for Python code calling `lm_eval.simple_evaluate`.
  - `python -m kiln.lm_eval_plugin ARGS...` is `lm_eval ARGS...` with the model registered, for
    an installation without the startup file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

MODEL_NAME = "kiln"
MODEL_TARGET = "kiln.lm_eval_model:KilnLM"
HOOKED_MODULE = "lm_eval.models"


def register() -> None:
    """Register the `kiln` model in lm-eval's model registry (idempotent)."""
    import lm_eval.models  # fills the registry with lm-eval's own models first

    _add_to(lm_eval.models)


def install() -> None:
    """Register `kiln` whenever lm-eval's model table is imported (now, if it already was)."""
    if HOOKED_MODULE in sys.modules:
        _add_to(sys.modules[HOOKED_MODULE])
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _add_to(models_module) -> None:
    from lm_eval.api.registry import model_registry

    models_module.MODEL_MAPPING.setdefault(MODEL_NAME, MODEL_TARGET)
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds `lm_eval.models` the usual way and runs `_add_to` after the module has executed."""

    def find_spec(self, name, path, target=None):
        if name != HOOKED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _add_to(module)


def main() -> None:
    """`lm_eval` with the kiln model registered."""
    register()
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
