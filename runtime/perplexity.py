"""Perplexity of a text under any compiled executable: how well the model predicts each next token.

    windows = token_windows(tokenizer.encode(text, add_special_tokens=False), length=512, count=4)
    result = perplexity(llm.executable, windows)     # result.perplexity, result.per_window

Each window is run as one prefill from position 0 on an empty cache (`executable.run` returns
logits for every position), so every backend is measured the same way; the first token of a
window is context only. Perplexity = exp(mean negative log-likelihood over predicted tokens).
`chunk=1` feeds the window one token at a time through the KV cache instead: the decode path,
whose kernels may differ from prefill's (e.g. int8-rounded activations in low-bit GEMVs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.runtime.errors import ContextLengthError, GenerationError


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token (nats)
    tokens: int  # tokens predicted
    per_window: tuple[float, ...]  # perplexity of each window


def token_windows(ids: Sequence[int], length: int, count: int) -> torch.Tensor:
    """Up to `count` non-overlapping windows of `length` tokens from the start of `ids`: [count, length]."""
    available = len(ids) // length
    if available == 0:
        raise GenerationError(
            f"the text has {len(ids)} tokens, fewer than one window of {length}. "
            "Fix: give a longer text, or a shorter window."
        )
    count = min(count, available)
    return torch.tensor(list(ids[: count * length]), dtype=torch.int64).view(count, length)


def window_nll(logits: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of window[1:] under logits[:-1] ([length, vocab]), per token."""
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -log_probs.gather(-1, window[1:, None]).squeeze(-1)


def window_logits(executable, window: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Logits [length, vocab] of one window from an empty cache, in one call or `chunk` tokens at a time."""
    executable.reset()
    step = chunk or len(window)
    positions = torch.arange(len(window))
    with torch.no_grad():
        return torch.cat(
            [
                executable.run(window[None, i : i + step], positions[None, i : i + step])[0]
                for i in range(0, len(window), step)
            ]
        )


def perplexity(executable, windows: torch.Tensor, chunk: int | None = None) -> PerplexityResult:
    """Perplexity of `executable` (a Kiln Executable) on token `windows` [count, length]; see the
    module docstring for `chunk`."""
    if windows.shape[1] > executable.options.max_seq_len:
        raise ContextLengthError(windows.shape[1], executable.options.max_seq_len)
    nlls = [window_nll(window_logits(executable, window, chunk), window) for window in windows]
    executable.reset()
    mean = torch.cat(nlls).mean().item()
    return PerplexityResult(
        math.exp(mean), mean, sum(len(n) for n in nlls), tuple(math.exp(n.mean().item()) for n in nlls)
    )
