"""Loading a checkpoint from this machine: a Hugging Face directory or a GGUF file.

Kiln never downloads: the source must be a local path. A directory needs `config.json`,
safetensors weights and `tokenizer.json`; pickled weights (`*.bin`, `*.pt`) are refused rather
than unpickled. A `.gguf` file is converted once into a cached directory
(`kiln.frontend.default_model.converted_gguf_dir`), so every model loads the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.frontend.default_model import converted_gguf_dir
from kiln.frontend.errors import CheckpointError, ModelNotFoundError

PICKLED_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")

# "owner/name" as the Hugging Face hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds
    from transformers import PretrainedConfig, PreTrainedModel


@dataclass
class LoadedModel:
    """A causal LM (or a reward model: `is_reward_model`) loaded for capture.

    Attributes:
        model: the transformers causal LM (or sequence classifier), fp32, in eval mode.
        config: its transformers config.
        tokenizer_path: the checkpoint's `tokenizer.json`.
        checkpoint_dir: the local Hugging Face directory it was loaded from.
        source_hash: sha256 over `config.json` and the safetensors weight files.
    """

    model: PreTrainedModel
    config: PretrainedConfig
    tokenizer_path: Path
    checkpoint_dir: Path
    source_hash: str


def load_model(source: str | os.PathLike) -> LoadedModel:
    """Load the causal LM at `source`, a local Hugging Face directory or `.gguf` file. A checkpoint
    whose config names a `*ForSequenceClassification` architecture with one label (a reward
    model, e.g. LlamaForSequenceClassification) loads as that class.

    Raises ModelNotFoundError when `source` is not on this machine, and CheckpointError when it
    is there but not loadable (no config, no safetensors weights, no tokenizer.json, not a
    causal LM transformers knows, weights that do not fit the config).
    """
    checkpoint_dir = resolve_checkpoint_dir(source)  # before the slow imports: bad paths fail fast
    config = _load_config(checkpoint_dir)

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    model_class = AutoModelForSequenceClassification if is_reward_config(config) else AutoModelForCausalLM
    model, loading_info = model_class.from_pretrained(
        checkpoint_dir,
        config=config,
        dtype=torch.float32,
        attn_implementation=attention_implementation(config),
        use_safetensors=True,
        local_files_only=True,
        output_loading_info=True,
    )
    _check_all_weights_loaded(checkpoint_dir, loading_info)
    model.eval()
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer_path=checkpoint_dir / "tokenizer.json",
        checkpoint_dir=checkpoint_dir,
        source_hash=checkpoint_sha256(checkpoint_dir),
    )


def is_reward_config(config: PretrainedConfig) -> bool:
    """Whether `config` describes a reward model: a `*ForSequenceClassification` architecture
    (CheckpointError unless it has the one label a scalar reward needs)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    architectures = getattr(config, "architectures", None) or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        return False
    if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise CheckpointError(
            f"'{architectures[0]}' names a sequence classifier, but transformers has none for "
            f"`{config.model_type}` models. Fix: pass a reward model of an architecture transformers "
            "has a *ForSequenceClassification class for (Llama, Qwen2, Mistral, Gemma, GPT-2, ...)."
        )
    if config.num_labels != 1:
        raise CheckpointError(
            f"{architectures[0]} with {config.num_labels} labels is a classifier, not a reward model; Kiln "
            "compiles sequence classifiers with one label (a scalar reward). Fix: pass a reward model "
            "checkpoint (num_labels=1), or its causal LM."
        )
    return True


def attention_implementation(config: PretrainedConfig) -> str:
    """ "sdpa" where the model class has that path, else "eager" (BLOOM, MPT, Gemma 2, ...): the
    capture keeps SDPA whole as `attention`, and `fuse_attention_pattern` recovers the same op
    from eager attention's matmul/softmax/matmul."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    model_class = _get_model_class(config, AutoModelForCausalLM._model_mapping)
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def resolve_checkpoint_dir(source: str | os.PathLike) -> Path:
    """The checked local Hugging Face directory for `source` (a GGUF file is converted first)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelNotFoundError(_not_found_message(str(source), path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(
                f"'{path}' is a file, but Kiln loads a Hugging Face model directory or a .gguf "
                "file. Fix: pass the directory that holds config.json and the weights."
            )
        path = converted_gguf_dir(path)
    path = path.resolve()
    check_checkpoint_dir(path)
    return path


def check_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Raise CheckpointError unless `checkpoint_dir` has a config, safetensors and tokenizer.json."""
    if not (checkpoint_dir / "config.json").is_file():
        raise CheckpointError(
            f"'{checkpoint_dir}' has no config.json, so it is not a Hugging Face model directory. "
            "Fix: pass the directory written by `save_pretrained` (config.json + *.safetensors "
            "+ tokenizer.json)."
        )
    if not _weight_files(checkpoint_dir):
        pickled = sorted(p.name for pattern in PICKLED_WEIGHT_PATTERNS for p in checkpoint_dir.glob(pattern))
        if pickled:
            raise CheckpointError(
                f"'{checkpoint_dir}' holds only pickled weights ({', '.join(pickled)}); Kiln never "
                "unpickles files, since unpickling can run arbitrary code. Fix: convert them once in "
                "a trusted environment, e.g. `AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(dir)`, which writes model.safetensors."
            )
        raise CheckpointError(
            f"'{checkpoint_dir}' has no *.safetensors weight files. Fix: save the model with "
            "`save_pretrained` (safetensors is its default) into that directory."
        )
    if not (checkpoint_dir / "tokenizer.json").is_file():
        raise CheckpointError(
            f"'{checkpoint_dir}' has no tokenizer.json (Kiln's runtime reads only fast tokenizers). "
            "Fix: `AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes one."
        )


def checkpoint_sha256(checkpoint_dir: Path) -> str:
    """sha256 over `config.json` and every safetensors file, each prefixed by its name."""
    digest = hashlib.sha256()
    for path in [checkpoint_dir / "config.json", *_weight_files(checkpoint_dir)]:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _weight_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, sorted by name."""
    return sorted(checkpoint_dir.glob("*.safetensors"))


def _load_config(checkpoint_dir: Path) -> PretrainedConfig:
    """The transformers config of `checkpoint_dir`, checked to describe a known causal LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    except (ValueError, KeyError, json.JSONDecodeError) as error:
        raise CheckpointError(
            f"transformers cannot read '{checkpoint_dir / 'config.json'}': {error}. Fix: check that "
            "the file is valid JSON with a `model_type` this transformers version knows."
        ) from error
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise CheckpointError(
            f"'{checkpoint_dir}' is a `{config.model_type}` model, which transformers has no causal "
            "LM class for; Kiln compiles decoder-only text generators. Fix: pass a causal LM "
            "checkpoint (GPT-2, Llama, Qwen2, Mistral, Gemma, ...)."
        )
    return config


def _check_all_weights_loaded(checkpoint_dir: Path, loading_info: dict) -> None:
    """Raise CheckpointError if transformers had to initialize parameters the checkpoint lacks.

    transformers only prints a report and fills such parameters with random values.
    """
    missing = sorted(loading_info["missing_keys"]) + sorted(key for key, *_ in loading_info["mismatched_keys"])
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"The weights in '{checkpoint_dir}' do not fit its config.json: {len(missing)} "
            f"parameters are missing or of the wrong shape ({shown}). Fix: pass the config.json "
            "saved together with these weights."
        )


def _not_found_message(source: str, path: Path) -> str:
    """Why `source` could not be found, and what to pass instead."""
    if _HUB_ID.match(source):
        return (
            f"'{source}' is not a local path. It looks like a Hugging Face hub id, but Kiln never "
            "downloads models. Fix: download it yourself, e.g. "
            f"`hf download {source} --local-dir models/{source.split('/')[-1]}`, then pass that "
            "directory (config.json + *.safetensors + tokenizer.json) or a local .gguf file."
        )
    return (
        f"No such file or directory: '{path}'. Fix: pass a local Hugging Face model directory "
        "(config.json + *.safetensors + tokenizer.json) or a local .gguf file."
    )
