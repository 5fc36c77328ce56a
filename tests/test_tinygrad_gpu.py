"""The tinygrad backend on a GPU (device="cuda"), run here without one: on tinygrad's Python
emulator of a CUDA GPU (`PYTHON::sm_80`: the kernels with their grids and local memory,
interpreted on the CPU), and on tinygrad's CPU device taking the GPU's code path (plain weight
layouts, staged feeds and logits, whole-row swaps) where speed matters more than the device."""

from __future__ import annotations

import pytest
import torch

import kiln
from hf_oracle import eos_ids, hf_greedy, prompts
from kiln.frontend.checkpoint import load_model

tinygrad_backend = pytest.importorskip("kiln.backends.tinygrad")
from kiln.backends.tinygrad import FeedError, TinygradDeviceError, TinygradExecutable, gpu_device  # noqa: E402

EMULATED_GPU = "PYTHON::sm_80"


def has_cpu_compiler() -> bool:
    from kiln.backends.tinygrad import CompilerNotFoundError, require_cpu_compiler

    try:
        require_cpu_compiler()
    except CompilerNotFoundError:
        return False
    return True


def tinygrad_opens_a_gpu() -> bool:
    from tinygrad.helpers import DEV

    default = DEV.value
    try:
        return gpu_device.gpu_device_opens()
    finally:
        DEV.value = default


GPU_HERE = tinygrad_opens_a_gpu()

# The GPU's code path on tinygrad's CPU device, which compiles with clang (a GPU machine may lack it)
on_the_cpu_device = pytest.mark.skipif(not has_cpu_compiler(), reason="tinygrad's CPU device needs clang")


@pytest.fixture
def gpu_as(monkeypatch):
    """Point device="cuda" at a tinygrad device; tinygrad's default device is restored after."""
    from tinygrad.helpers import DEV

    default = DEV.value

    def use(device: str) -> None:
        monkeypatch.setattr(gpu_device, "GPU_DEVICE", device)

    yield use
    DEV.value = default


def compile_for_gpu(source, tmp_path, **options):
    return kiln.compile(
        str(source), out=tmp_path / "model.kiln", backend="tinygrad", device="cuda", max_seq_len=32, **options
    )


@pytest.mark.slow
def test_greedy_on_an_emulated_gpu_equals_hugging_face(tiny_model_dirs, tmp_path, gpu_as):
    gpu_as(EMULATED_GPU)
    source = tiny_model_dirs("llama")
    llm = kiln.load(compile_for_gpu(source, tmp_path, max_batch=1), device="cuda")
    assert isinstance(llm.executable, TinygradExecutable) and llm.executable.on_gpu
    weight = next(iter(llm.executable.params.values()))
    assert weight.device.startswith("PYTHON")  # on the emulated GPU, not the CPU device
    (prompt,) = prompts([5])
    result = llm.generate(prompt, max_new_tokens=4)
    assert result.token_ids == hf_greedy(load_model(source).model, prompt, 4, eos_ids(llm))


@on_the_cpu_device
def test_a_later_row_runs_swapped_in_whole_and_leaves_row_zero_alone(tiny_model_dirs, tmp_path, gpu_as):
    gpu_as("CPU")
    executable = kiln.load(compile_for_gpu(tiny_model_dirs("llama"), tmp_path, max_batch=2), device="cuda").executable
    assert executable.on_gpu and not executable.copies_rows
    first, second = (torch.tensor([p]) for p in prompts([6, 6], seed=3))
    positions = torch.arange(6)[None]
    alone = executable.run(second, positions)
    executable.reset()
    executable.run(first, positions)  # row 0's request
    at_row_one = executable.run(second, positions, first_row=1)
    torch.testing.assert_close(at_row_one, alone, rtol=0, atol=0)
    both = torch.cat([first, second])
    next_tokens, next_positions = torch.tensor([[7], [8]]), torch.tensor([[6], [6]])
    decoded = executable.run(next_tokens, next_positions)  # both rows decode from their own keys
    executable.reset()
    executable.run(both, positions.expand(2, 6))
    torch.testing.assert_close(decoded, executable.run(next_tokens, next_positions), rtol=0, atol=0)
    with pytest.raises(FeedError, match="not host memory"):
        executable.cache_views()


@pytest.mark.skipif(GPU_HERE, reason="tinygrad opens a GPU here")
def test_without_a_gpu_the_artifact_waits_for_one_and_loading_names_the_fix(tiny_model_dirs, tmp_path, gpu_as):
    gpu_as("CUDA")  # tinygrad cannot open it on this machine (no libcuda)
    path = compile_for_gpu(tiny_model_dirs("llama"), tmp_path, dtype="f16")
    assert (path / "tinygrad.json").is_file()
    with pytest.raises(TinygradDeviceError, match="cannot open its CUDA device.*Fix: load the artifact on a machine"):
        kiln.load(path, device="cuda")


@pytest.mark.skipif(not GPU_HERE, reason="needs a GPU tinygrad can open (bench/gpu_run.sh runs it on one)")
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma3"])
def test_greedy_on_the_gpu_equals_hugging_face_at_batch_one_and_two(tiny_model_dirs, tmp_path, arch):
    source = tiny_model_dirs(arch)
    llm = kiln.load(compile_for_gpu(source, tmp_path, max_batch=2), device="cuda")
    model, batch = load_model(source).model, prompts([5, 9], seed=2)
    results = llm.generate(batch, max_new_tokens=12)
    for prompt, result in zip(batch, results):
        assert result.token_ids == hf_greedy(model, prompt, 12, eos_ids(llm))


@pytest.mark.slow
@on_the_cpu_device
@pytest.mark.parametrize("scheme", ["int4-g32", "int8"])
def test_quantized_weights_on_the_gpu_path_give_the_reference_backends_tokens(
    tiny_model_dirs, tmp_path, gpu_as, scheme
):
    """On a GPU the codes keep their plain layout (no packing) and dequantize in the graph."""
    gpu_as("CPU")
    source = tiny_model_dirs("llama")
    quantized = {"quantize": scheme, "quantize_embeddings": True}
    gpu = kiln.load(compile_for_gpu(source, tmp_path / "gpu", **quantized), device="cuda")
    assert not any(s.packed for s in gpu.executable.layouts.stored.values())
    reference = kiln.load(
        kiln.compile(str(source), out=tmp_path / "reference.kiln", backend="reference", max_seq_len=32, **quantized)
    )
    (prompt,) = prompts([9], seed=2)
    want = reference.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids
    assert gpu.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == want
