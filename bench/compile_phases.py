"""Where a cold compile's time goes: `compile-model` run in this process, with torch's compile-time
counters and each g++ build of the AOTInductor package timed.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) flock /tmp/kiln-bench.lock chrt -f 10 \
        .venv/bin/python bench/compile_phases.py OUT.kiln [MODEL] [compile-model options]

Always `--no-cache` (Kiln's compile cache); a fresh `TORCHINDUCTOR_CACHE_DIR` makes Inductor's
cold too. Prints compile-model's own phase lines, then the spans of the package step (export,
AOTInductor), the g++ builds in order, and torch's counters (`torch._dynamo.utils.compile_times`).
"""

import functools
import sys
import time

import torch
import torch._dynamo.utils
import torch._inductor.cpp_builder as cpp_builder

from kiln.backends.inductor import aoti_package
from kiln.cli import compile_model_main

builds, spans = [], []
_build = cpp_builder.CppBuilder.build


def timed_build(self):
    start = time.perf_counter()
    _build(self)
    builds.append((self._name[-40:], time.perf_counter() - start))


def timed(module, name):
    function = getattr(module, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spans.append((name, time.perf_counter() - start))

    setattr(module, name, wrapper)


cpp_builder.CppBuilder.build = timed_build
timed(aoti_package, "export_module")
timed(torch._inductor, "aot_compile")
start = time.perf_counter()
status = compile_model_main(["-o", sys.argv[1], "--no-cache", *sys.argv[2:]])
print(f"total {time.perf_counter() - start:.1f} s (exit status {status})")
for name, seconds in spans:
    print(f"  {name}: {seconds:.1f} s")
for name, seconds in builds:
    print(f"  g++ {name}: {seconds:.1f} s")
print(torch._dynamo.utils.compile_times(repr="str"))
