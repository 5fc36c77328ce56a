"""Shared fixtures: tiny random-weight checkpoints per architecture, and the real SmolLM2.

`tiny_model_dir` runs a test once per architecture in `ARCHITECTURES`; narrow it with
`@pytest.mark.parametrize("arch", ["llama"])`. `tiny_model_dirs("qwen2")` gives one directly.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import triton_mode  # noqa: F401 - first: Triton's kernels interpreted without a GPU
from kiln.frontend.default_model import default_gguf_path, default_model_dir
from kiln.frontend.errors import ModelNotFoundError
from tiny_models import ARCHITECTURES, save_tiny_checkpoint

# Tests compile the same tiny models under different monkeypatched settings, which no cache key
# sees: they compile afresh (tests/test_compile_cache.py turns the cache on in a tmp directory).
os.environ["KILN_COMPILE_CACHE"] = "off"


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> Callable[[str], Path]:
    """A function from architecture name to its tiny checkpoint directory, built once per session."""
    root = tmp_path_factory.mktemp("tiny_models")

    @functools.cache
    def build(arch: str) -> Path:
        return save_tiny_checkpoint(arch, root / arch)

    return build


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    """An architecture name; every one in ARCHITECTURES unless a test parametrizes `arch`."""
    return request.param


@pytest.fixture
def tiny_model_dir(tiny_model_dirs, arch) -> Path:
    """The tiny checkpoint directory of `arch`."""
    return tiny_model_dirs(arch)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a local HF directory (converted from the GGUF on first use)."""
    try:
        default_gguf_path()
    except ModelNotFoundError as error:
        pytest.skip(f"the default model is not installed: {error}")
    return default_model_dir()


@pytest.fixture
def exact_activations(monkeypatch):
    """ONNX Runtime's MatMulNBits at accuracy level 0 (f32 activations): the interpreter's exact
    arithmetic, for tests that compare the two closely (the default, 4, rounds them to int8)."""
    from kiln.backends.onnxruntime import quantized_lowerings

    monkeypatch.setattr(quantized_lowerings, "ACCURACY_LEVEL", 0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small matrices: one thread (several only wait on each other when the cores are shared).
    A module asks for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gemv_kernels_two_threads():
    """Kiln's linear kernels built and loaded (skips without a C++ compiler), torch at 2 threads,
    and the AVX-512 kernels back on afterwards. A module asks for it with
    `pytestmark = pytest.mark.usefixtures("gemv_kernels_two_threads")`."""
    import shutil

    from kiln.backends.inductor import gemv_kernel

    if shutil.which(os.environ.get("CXX") or "g++") is None:
        pytest.skip("no C++ compiler: the kiln GEMV kernel cannot be built here")
    gemv_kernel.ensure_loaded()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
    torch.ops.kiln.gemv_use_avx512(True)
