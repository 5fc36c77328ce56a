"""Kiln: a compiler-first runtime for large language models.

    import kiln
    kiln.compile("path/to/hf-model", out="model.kiln", backend="inductor")
    llm = kiln.load("model.kiln")
    print(llm.generate("Once upon a time", max_new_tokens=32).text)

The names below are resolved on first use, so `import kiln.ir` (which runs this file first)
stays light and never imports the runtime or the frontend.
"""

import importlib

_EXPORTS = {
    "compile": "kiln.api",
    "load": "kiln.api",
    "quality": "kiln.runtime.quality",
    "LLM": "kiln.runtime.generate",
    "GenerationResult": "kiln.runtime.results",
    "GenerationStats": "kiln.runtime.results",
    "KilnError": "kiln.ir.errors",
    "OptionError": "kiln.ir.errors",
    "UnsupportedOpError": "kiln.ir.errors",
    "CheckpointError": "kiln.frontend.errors",
    "ModelNotFoundError": "kiln.frontend.errors",
    "ArtifactError": "kiln.runtime.errors",
    "ContextLengthError": "kiln.runtime.errors",
    "GenerationError": "kiln.runtime.errors",
    "TokenizerError": "kiln.runtime.errors",
    "TokenIdError": "kiln.runtime.errors",
    "BackendNotFoundError": "kiln.backends.registry",
    "GraphBreakError": "kiln.frontend.breaks.compile_check",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolve once
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
