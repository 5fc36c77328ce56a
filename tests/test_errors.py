"""Kiln's error tree: every error class Kiln defines is a KilnError, one class per kind."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import kiln
from kiln.ir.errors import KilnError

PACKAGES = [
    "kiln",
    "kiln.frontend",
    "kiln.ir",
    "kiln.ir.ops",
    "kiln.passes",
    "kiln.backends",
    "kiln.backends.inductor",
    "kiln.backends.onnxruntime",
    "kiln.backends.tinygrad",
    "kiln.runtime",
]


def kiln_modules():
    for package in PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            name = f"{package}.{info.name}"
            if info.ispkg or name == "kiln.__main__":
                continue
            try:
                yield importlib.import_module(name)
            except ImportError:  # an optional extra that is not installed
                continue


def test_every_error_class_kiln_defines_is_a_kiln_error():
    errors = {
        value
        for module in kiln_modules()
        for value in vars(module).values()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__.startswith("kiln.")
    }
    assert len(errors) > 30
    assert [e.__qualname__ for e in errors if not issubclass(e, KilnError)] == []


def test_each_kind_of_failure_is_one_class_under_every_name_it_had():
    from kiln.backends import errors, inductor, onnxruntime, tinygrad
    from kiln.frontend import errors as frontend_errors
    from kiln.ir import errors as ir_errors
    from kiln.runtime import errors as runtime_errors

    assert inductor.FeedError is onnxruntime.FeedError is tinygrad.FeedError is errors.FeedError
    assert (
        inductor.UnsupportedOpError
        is tinygrad.UnsupportedOpError
        is frontend_errors.UnsupportedOpError
        is kiln.UnsupportedOpError
        is ir_errors.UnsupportedOpError
    )
    assert inductor.LoweringError is onnxruntime.OnnxLoweringError is errors.LoweringError
    assert inductor.PackageError is tinygrad.TinygradArtifactError is runtime_errors.ArtifactError
    # code that caught the builtin each used to be keeps working
    assert issubclass(errors.FeedError, ValueError) and issubclass(ir_errors.UnsupportedOpError, NotImplementedError)
    assert issubclass(ir_errors.OptionError, ValueError)
