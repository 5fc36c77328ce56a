"""A GPT-2 small checkpoint with seeded random weights, for the tinygrad benchmarks (no hub access).

    .venv/bin/python bench/gpt2_small.py [DIR]     # writes DIR (default out/bench-gpt2-small)

GPT2Config() defaults: 12 layers, 768 wide, 12 heads, vocab 50257, 1024 positions (124 M
parameters, 475 MiB in f32). The tokenizer is a stub (a few words): the benchmarks feed token ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "out" / "bench-gpt2-small"


def stub_tokenizer_json() -> str:
    """A word-level tokenizer.json; Kiln's loader wants one, the benchmarks never decode text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(
        models.WordLevel({"<|endoftext|>": 50256, "hello": 31373, "world": 995}, unk_token="<|endoftext|>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


def gpt2_small_dir(directory: Path = DEFAULT_DIR, seed: int = 0) -> Path:
    """The checkpoint directory, written on first use."""
    directory = Path(directory)
    if (directory / "model.safetensors").is_file():
        return directory
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(stub_tokenizer_json())
    return directory


if __name__ == "__main__":
    print(gpt2_small_dir(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR))
