"""What `kiln.compile` is asked for, checked before any slow step.

`CompileOptions.checked(...)` takes `kiln.compile`'s arguments and refuses, with a `KilnError`
that names the option and the fix, every value the compile could not finish with: a wrong type,
a number out of range, a dtype or device the backend cannot target, an unknown backend or
quantization scheme, options that do nothing without another (calibration without an -awq
scheme), an output path that cannot be written. So a mistake costs milliseconds, not the
minutes of capture and lowering it used to run first.

What needs the model's own shape (the KV cache's size) is checked as soon as the model is
loaded, before the capture: `check_memory`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.backends.executable import BackendOptions
from kiln.ir.errors import OptionError
from kiln.passes.insert_kv_cache import KV_CACHE_KINDS, KV_LAYOUTS

COMPUTE_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# The backends that target device='cuda' and the dtypes each computes in there (onnxruntime: no bf16,
# its CUDA kernels cover bf16 only in part).
CUDA_DTYPES = {"inductor": ("f32", "f16", "bf16"), "onnxruntime": ("f32", "f16"), "tinygrad": ("f32", "f16", "bf16")}
HALF_QUANTIZED_BACKENDS = ("inductor",)  # whose linear_q / embedding_q compute in f16 and bf16
DEVICE = re.compile(r"(cpu|cuda)(:\d+)?")
BACKENDS_WITH_TENSOR_PARALLEL = ("inductor", "reference")


TOKEN_TREE_BACKENDS = frozenset({"inductor", "onnxruntime", "reference", "tinygrad"})
INT8_KV_BACKENDS = ("inductor", "reference")  # whose attention reads an int8 cache (docs/kv-cache.md)
PAGED_KV_BACKENDS = ("inductor", "onnxruntime", "reference")  # whose kv_write and attention read through a block table


@dataclass(frozen=True)
class CompileOptions:
    """Every option of one compile, checked (build it with `CompileOptions.checked`)."""

    model: str | Path | None
    out: Path
    backend: str = "inductor"
    max_seq_len: int = 1024
    max_batch: int = 1
    dtype: str = "f32"
    device: str = "cpu"
    quantize: str | None = None
    quantize_embeddings: bool = False
    calibration: object = None
    tensor_parallel: int = 1
    dump_ir: Path | None = None
    kv_cache: str = "f32"
    kv_layout: str = "static"
    kv_block_size: int = 32
    kv_blocks: int | None = None

    @classmethod
    def checked(cls, **given) -> CompileOptions:
        """The options, or the KilnError of the first one that is wrong (in the order below)."""
        options = cls(**{**given, "quantize": None if given.get("quantize") in (None, "none") else given["quantize"]})
        checks = (
            _check_numbers,
            _check_target,
            _check_quantize,
            _check_kv_cache,
            _check_kv_layout,
            _check_tensor_parallel,
            _check_paths,
        )
        for check in checks:
            check(options)
        from kiln.backends.registry import get_backend

        get_backend(options.backend)  # an unknown or unusable backend fails here, not after the capture
        return options

    @property
    def scheme(self):
        """The quantization scheme, or None."""
        from kiln.passes.quant_schemes import get_scheme

        return get_scheme(self.quantize) if self.quantize else None

    @property
    def needs_calibration(self) -> bool:
        return self.scheme is not None and self.scheme.needs_calibration

    @property
    def torch_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.dtype]

    @property
    def token_trees(self) -> bool:
        """Whether the stateful graph takes a token tree (kiln.backends.token_trees): on the backends
        whose attention lowers one."""
        return self.backend in TOKEN_TREE_BACKENDS

    def backend_options(self) -> BackendOptions:
        """What the passes and the backend are told (the manifest records it)."""
        return BackendOptions(
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            dtype=self.dtype,
            quantize=self.quantize,
            quantize_embeddings=self.quantize_embeddings,
            device=self.device,
            kv_cache=self.kv_cache,
            kv_layout=self.kv_layout,
            kv_block_size=self.kv_block_size,
            kv_blocks=self.kv_blocks,
        )

    def manifest_options(self, calibration_source: str | None) -> dict:
        return {**dataclasses.asdict(self.backend_options()), "calibration": calibration_source}


def _positive_int(name: str, flag: str, value, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(
            f"{name} must be a whole number of at least 1, got {value!r}. "
            f"Fix: pass e.g. {name}={example} ({flag} {example})."
        )


def _check_numbers(options: CompileOptions) -> None:
    _positive_int("max_seq_len", "--max-seq-len", options.max_seq_len, 1024)
    _positive_int("max_batch", "--max-batch", options.max_batch, 1)
    _positive_int("tensor_parallel", "--tensor-parallel", options.tensor_parallel, 1)
    if not isinstance(options.quantize_embeddings, bool):
        raise OptionError(f"quantize_embeddings must be True or False, got {options.quantize_embeddings!r}.")


def _check_target(options: CompileOptions) -> None:
    """A dtype or device the target cannot run (the manifest records them)."""
    dtype, backend, device, quantize = options.dtype, options.backend, options.device, options.quantize
    if not isinstance(backend, str):
        raise OptionError(f"backend must be a name, got {backend!r}. Fix: backend='inductor' (--backend inductor).")
    if dtype not in COMPUTE_DTYPES:
        raise OptionError(
            f"dtype {dtype!r} is not one Kiln compiles. Fix: use one of {sorted(COMPUTE_DTYPES)} "
            "(and quantize='int8' or 'int4-g32' for smaller weights)."
        )
    if not isinstance(device, str) or not DEVICE.fullmatch(device):
        raise OptionError(
            f"device {device!r} is not one Kiln targets. Fix: device='cpu', or 'cuda' / 'cuda:N' "
            "(--device cpu|cuda[:N])."
        )
    on_cpu = device.split(":")[0] == "cpu"
    if dtype != "f32" and on_cpu:
        raise OptionError(
            f"dtype {dtype!r} is for GPUs: Kiln lowers it for device='cuda' with backend='inductor' "
            f"or 'onnxruntime' (got backend={backend!r}, device={device!r}); CPUs without native half "
            "precision run half-precision matmuls far slower than f32. Fix: dtype='f32' on the CPU (with "
            "quantize='int8' or 'int4-g32' for smaller weights), or device='cuda' with backend='inductor'."
        )
    if not on_cpu and backend not in CUDA_DTYPES:
        raise OptionError(
            f"device {device!r}: the {backend} backend runs on the CPU only so far. Fix: "
            f"device='cpu', or a backend that runs on CUDA: backend={' or '.join(map(repr, CUDA_DTYPES))}."
        )
    if not on_cpu and dtype not in CUDA_DTYPES[backend]:
        raise OptionError(
            f"dtype {dtype!r} is not supported by the {backend} backend: ONNX Runtime's CUDA kernels "
            f"cover bf16 only in part. Fix: dtype='f16' for {backend}, or backend='inductor' for {dtype}."
        )
    if dtype != "f32" and quantize is not None and backend not in HALF_QUANTIZED_BACKENDS:
        raise OptionError(
            f"quantize={quantize!r} with dtype {dtype!r} is not supported yet by the {backend} backend: it "
            "lowers quantized weights for f32 graphs only. Fix: dtype='f32' with quantize, dtype="
            f"{dtype!r} without it, or backend='inductor' for quantize with dtype {dtype!r}."
        )


def _check_quantize(options: CompileOptions) -> None:
    if options.quantize is not None and not isinstance(options.quantize, str):
        raise OptionError(f"quantize must be a scheme name, got {options.quantize!r}. Fix: e.g. quantize='int8'.")
    scheme = options.scheme  # an unknown name raises UnknownSchemeError, listing the known ones
    if options.quantize_embeddings and scheme is None:
        raise OptionError(
            "quantize_embeddings quantizes the lm_head and embedding with the quantize scheme, "
            "and no scheme is given. Fix: add --quantize SCHEME (e.g. int8), or drop "
            "--quantize-embeddings."
        )
    if scheme is not None and scheme.needs_calibration and options.dtype != "f32":
        raise OptionError(
            f"quantize={options.quantize!r} measures activations on calibration text, which Kiln does "
            f"in f32 graphs only so far, not dtype {options.dtype!r}. Fix: a round-to-nearest or fitted "
            f"scheme with dtype {options.dtype!r} (e.g. int8, int4-g32, int4-g32-asym, int4-g32-fit), "
            f"or dtype='f32' for {options.quantize!r}."
        )
    if options.calibration is not None and not options.needs_calibration:
        raise OptionError(
            f"calibration is read only by the data-aware (-awq) schemes, not quantize="
            f"{options.quantize!r}. Fix: pick an -awq scheme (e.g. int4-g64-awq), or drop --calibration."
        )
    if options.needs_calibration:
        from kiln.calibration import check_source

        with _path_errors("calibration", options.calibration):
            check_source(options.calibration)


def _check_kv_cache(options: CompileOptions) -> None:
    kind = options.kv_cache
    if not isinstance(kind, str) or kind not in KV_CACHE_KINDS:
        raise OptionError(
            f"kv_cache {kind!r} is not a KV-cache kind Kiln builds. "
            "Fix: kv_cache='f32' or 'int8' (--kv-cache f32|int8)."
        )
    if kind == "f32":
        return
    if options.backend not in INT8_KV_BACKENDS:
        raise OptionError(
            f"kv_cache='int8' is not supported by the {options.backend} backend: "
            + INT8_KV_REFUSALS.get(options.backend, "its attention reads an f32 cache only.")
            + " Fix: backend='inductor' (or 'reference') for an int8 KV cache, "
            + f"or kv_cache='f32' with {options.backend}."
        )
    if options.dtype != "f32":
        raise OptionError(f"kv_cache='int8' quantizes f32 keys and values, not {options.dtype}. Fix: dtype='f32'.")
    if options.tensor_parallel > 1:
        raise OptionError(
            "kv_cache='int8' is not sharded over ranks yet. Fix: drop --tensor-parallel, or use kv_cache='f32'."
        )


def _check_kv_layout(options: CompileOptions) -> None:
    if options.kv_layout not in KV_LAYOUTS:
        raise OptionError(
            f"kv_layout {options.kv_layout!r} is not a KV-cache layout Kiln builds. "
            "Fix: kv_layout='static' or 'paged' (--kv-layout static|paged)."
        )
    if options.kv_layout == "static":
        return
    if options.backend not in PAGED_KV_BACKENDS:
        raise OptionError(
            f"kv_layout='paged' is not supported by the {options.backend} backend yet: its kv_write and "
            "attention lowerings address static rows, not blocks through a block table. "
            f"Fix: kv_layout='static' (--kv-layout static) with {options.backend}, or backend='inductor'."
        )
    _positive_int("kv_block_size", "--kv-block-size", options.kv_block_size, 32)
    if options.kv_blocks is not None:
        _positive_int("kv_blocks", "--kv-blocks", options.kv_blocks, 1024)
        per_row = -(-options.max_seq_len // options.kv_block_size)
        if options.kv_blocks - 1 < per_row:
            raise OptionError(
                f"kv_blocks={options.kv_blocks} cannot hold one sequence of max_seq_len={options.max_seq_len} "
                f"({per_row} blocks of {options.kv_block_size}, plus a scratch block). "
                f"Fix: --kv-blocks {per_row + 1} or more, or a smaller --max-seq-len."
            )
    if options.tensor_parallel > 1:
        raise OptionError("kv_layout='paged' is not sharded over ranks yet. Fix: drop --tensor-parallel, or static.")


INT8_KV_REFUSALS = {
    "onnxruntime": "its GroupQueryAttention quantizes the cache with fixed per-tensor or per-channel scales "
    "(k_quant_type), not Kiln's scale per token and head, so it would compute another model.",
    "tinygrad": "its attention lowering reads an f32 cache only.",
}


def _check_tensor_parallel(options: CompileOptions) -> None:
    if options.tensor_parallel == 1:
        return
    from kiln.passes.shard_tensor_parallel import ShardingError

    if options.backend not in BACKENDS_WITH_TENSOR_PARALLEL:
        raise ShardingError(
            f"the {options.backend} backend cannot run a tensor-parallel graph. "
            "Fix: use --backend inductor (or reference), or drop --tensor-parallel"
        )
    if options.quantize:
        raise ShardingError(
            "tensor parallelism does not shard quantized weights yet. Fix: drop --quantize or --tensor-parallel"
        )


def _check_paths(options: CompileOptions) -> None:
    """The artifact and the IR dumps must be writable where asked, or the compile would fail at its end."""
    from kiln.runtime.artifact import check_replaceable

    if not isinstance(options.out, (str, Path)) or not str(options.out):
        raise OptionError(
            f"out must be a directory path, got {options.out!r}. Fix: e.g. out='model.kiln' (-o model.kiln)."
        )
    with _path_errors("out", options.out):
        check_replaceable(Path(options.out))
        _check_writable_dir("out", Path(options.out))
    if options.dump_ir is not None:
        dump = Path(options.dump_ir)
        with _path_errors("dump_ir", dump):
            if dump.exists() and not dump.is_dir():
                raise OptionError(
                    f"dump_ir {dump} exists and is not a directory. Fix: give a directory (--dump-ir DIR)."
                )
            _check_writable_dir("dump_ir", dump)


@contextmanager
def _path_errors(name: str, path):
    """An OSError looking at `path` (a name too long, a permission) as the option's error."""
    try:
        yield
    except OSError as error:
        raise OptionError(
            f"{name} {str(path)[:80]!r} cannot be used: {error.strerror or error}. Fix: choose another path."
        ) from None


def _check_writable_dir(name: str, path: Path) -> None:
    """`path` (a directory to create or fill) can be written: its nearest existing ancestor is a
    writable directory."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise OptionError(f"{name} {path} cannot be created: {existing} is a file. Fix: choose another path.")
    if not os.access(existing, os.W_OK):
        raise OptionError(f"{name} {path} cannot be written: {existing} is not writable. Fix: choose another path.")


def kv_cache_bytes(config, options: CompileOptions) -> int | None:
    """The bytes of the static KV buffers (and rope tables) the compile allocates for `config`, a
    Hugging Face model config; None when the config does not say its shape."""
    config = getattr(config, "text_config", None) or config
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not all(isinstance(n, int) and n > 0 for n in (layers, heads, hidden)):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_token = layers * kv_bytes_per_token(kv_heads, head_dim, options)
    slots = kv_slots(options)
    return per_token * slots + head_dim * 4 * options.max_seq_len


def kv_slots(options) -> int:
    """How many tokens' keys and values the cache holds: max_batch rows of max_seq_len, or the
    paged pool's blocks (as many as the rows by default, plus a scratch block)."""
    if getattr(options, "kv_layout", "static") != "paged":
        return options.max_batch * options.max_seq_len
    per_row = -(-options.max_seq_len // options.kv_block_size)
    return (options.kv_blocks or options.max_batch * per_row + 1) * options.kv_block_size


def kv_bytes_per_token(kv_heads: int, head_dim: int, options) -> int:
    """The KV bytes one layer stores per token of one row: keys and values, in the compute dtype,
    or int8 codes with one f32 scale per head each."""
    if getattr(options, "kv_cache", "f32") == "int8":
        return 2 * kv_heads * (head_dim + 4)
    return 2 * kv_heads * head_dim * (torch.finfo(COMPUTE_DTYPES[options.dtype]).bits // 8)


def check_memory(config, options: CompileOptions) -> None:
    """Refuse a max_batch x max_seq_len whose KV cache could not fit this machine's memory (a CPU
    target allocates it here, while lowering)."""
    needed = kv_cache_bytes(config, options)
    if options.device.split(":")[0] != "cpu" or needed is None:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > total:
        raise OptionError(
            f"max_batch={options.max_batch} x max_seq_len={options.max_seq_len} needs a KV cache of "
            f"{needed / 1e9:.1f} GB for this model, more than this machine's {total / 1e9:.1f} GB of "
            "memory. Fix: a smaller --max-seq-len or --max-batch."
        )
