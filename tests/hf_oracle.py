"""The oracle: Hugging Face's greedy continuation, and the prompts the end-to-end tests feed."""

import torch

from tiny_models import VOCAB_SIZE


def hf_greedy(model, prompt: list[int], new_tokens: int, eos_ids) -> list[int]:
    """Hugging Face's greedy continuation, cut after the first end-of-sequence token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    for i, t in enumerate(out):
        if t in eos_ids:
            return out[: i + 1]
    return out


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def eos_ids(llm):
    return set(llm.tokenizer.eos_ids) if llm.tokenizer else set()
