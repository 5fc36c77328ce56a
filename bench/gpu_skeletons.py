"""Artifacts that travel to a GPU machine without their weights (bench/gpu.py, gpu_real.py,
gpu_profile.py): random-weight checkpoints of a model's shape, artifacts compiled here for CUDA,
their weights file cut to its header (a skeleton) and filled again there with random values of
the recorded dtypes and shapes, and one shared copy of their common tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

LLAMA_1B = {  # Llama-3.2-1B's shape
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
WEIGHTS, HEADER = "weights.safetensors", "weights.header"


SHARED_TOKENIZER = "tokenizer.json"


def share_tokenizers(directory: Path) -> None:
    """Keep one copy of the artifacts' common tokenizer.json (SmolLM2's is 3.5 MB each), so that
    the directory travels within a copy limit; `restore_tokenizers` puts them back."""
    shared = directory / SHARED_TOKENIZER
    for copy in sorted(directory.glob(f"*.kiln/{SHARED_TOKENIZER}")):
        if copy.stat().st_size > 1 << 20:
            if not shared.is_file():
                shared.write_bytes(copy.read_bytes())
            if copy.read_bytes() == shared.read_bytes():
                copy.unlink()


def restore_tokenizers(directory: Path) -> None:
    shared = directory / SHARED_TOKENIZER
    for artifact in sorted(directory.glob("*.kiln")):
        listed = SHARED_TOKENIZER in json.loads((artifact / "manifest.json").read_text()).get("files", {})
        if listed and not (artifact / SHARED_TOKENIZER).is_file():
            (artifact / SHARED_TOKENIZER).write_bytes(shared.read_bytes())


def compile_for_cuda(kiln, checkpoint, out, dtype, quantize, max_batch, max_seq_len, backend="inductor") -> None:
    kiln.compile(
        str(checkpoint),
        out=out,
        backend=backend,
        device="cuda",
        dtype=dtype,
        quantize=quantize,
        quantize_embeddings=quantize is not None,
        max_batch=max_batch,
        max_seq_len=max_seq_len,
    )
    print(f"prepared {out.name}", flush=True)


def shaped_checkpoint(model: str, directory: Path) -> Path:
    """A random-weight checkpoint of the model's shape (the real SmolLM2's, the Llama 1B above)."""
    out = directory / model
    if (out / "config.json").is_file():
        return out
    import transformers

    from kiln.frontend.default_model import default_model_dir

    if model == "smollm2":
        config = transformers.AutoConfig.from_pretrained(default_model_dir())
    else:
        config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_1B.items() if k != "architectures"})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.save_pretrained(out)
    # SmolLM2's tokenizer (an artifact needs one; its ids lie within either vocabulary)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = default_model_dir() / name
        if source.is_file():
            (out / name).write_bytes(source.read_bytes())
    return out


def to_skeleton(artifact: Path) -> None:
    """Keep the weights file's header (dtypes, shapes, offsets) and drop its data."""
    path = artifact / WEIGHTS
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = f.read(length)
    (artifact / HEADER).write_bytes(len(header).to_bytes(8, "little") + header)
    path.unlink()


def fill(artifact: Path) -> None:
    """weights.safetensors from the header: floats N(0, 0.02), integers random bytes."""
    if (artifact / WEIGHTS).is_file():
        return
    raw = (artifact / HEADER).read_bytes()
    header = json.loads(raw[8:])
    generator = torch.Generator().manual_seed(0)
    tile = {  # values repeat every 16M elements: speed does not depend on them
        torch.float32: torch.randn(1 << 24, generator=generator) * 0.02,
        "bytes": torch.randint(0, 256, (1 << 24,), dtype=torch.uint8, generator=generator),
    }
    with open(artifact / WEIGHTS, "wb") as out:
        out.write(raw)
        start = out.tell()
        for _name, info in sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
        ):
            begin, end = info["data_offsets"]
            out.seek(start + begin)
            out.write(tile_bytes(tile, info["dtype"], end - begin))
    print(f"filled {artifact.name} ({(artifact / WEIGHTS).stat().st_size / 1e9:.2f} GB)", flush=True)


FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def tile_bytes(tile: dict, dtype: str, length: int) -> bytes:
    if dtype in FLOATS:
        values = tile[torch.float32].to(FLOATS[dtype])
        if dtype != "F32":  # scales, norms: positive and small keeps activations finite
            values = values.abs() + 0.01 if length < (1 << 20) else values
        source = values.view(torch.uint8)
    else:
        source = tile["bytes"]
    reps = -(-length // source.numel())
    return (source.repeat(reps)[:length]).numpy().tobytes() if reps > 1 else source[:length].numpy().tobytes()


def weight_bytes(artifact: Path) -> int:
    """Bytes of weights a decode step reads: all but the tables only gathered from (an untied
    embedding reads one row a token; a tied one is read whole by the lm_head, so it counts)."""
    from kiln.ir import parse_graph

    graph = parse_graph((artifact / "graph.kir").read_text())
    gathered = {
        name
        for name, value in graph.params.items()
        if value.users and all(n.op in ("embedding", "embedding_q") for n in value.users)
    }
    header = json.loads((artifact / HEADER).read_bytes()[8:])
    return sum(
        info["data_offsets"][1] - info["data_offsets"][0]
        for name, info in header.items()
        if name != "__metadata__" and name not in gathered
    )
