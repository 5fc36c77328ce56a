"""A reference model's next-token distributions over token windows, stored compactly for reuse.

    reference = reference_logits(executable, windows, top_k=256)   # runs each window once
    reference.save("f32.logits")                                    # ~10 MB for 19 windows of 512
    reference = ReferenceLogits.load("f32.logits")

Per scored position it keeps the `top_k` most likely token ids with their log-probabilities
(f32), the log of the probability mass outside them, and the log-probability of the token that
actually follows. `kiln.runtime.quality` compares another model against it without rerunning
the reference: the KL divergence over the top-k tokens plus one "rest" bucket is a lower bound
of the full one, tight when the rest's mass is small (docs/numerics.md measures the gap).

Scoring follows llama.cpp's `llama-perplexity`: windows of `length` tokens from the start of the
text, and within each only positions from `first` on are scored (default: the second half), so
every scored token has at least `first` tokens of context.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.ir.errors import KilnError
from kiln.runtime.errors import ContextLengthError
from kiln.runtime.perplexity import window_logits

FORMAT = "kiln-reference-logits/1"
DEFAULT_TOP_K = 256


class QualityError(KilnError, ValueError):
    """Two models (or a model and a stored reference) cannot be compared as asked."""


@dataclass(frozen=True)
class ReferenceLogits:
    tokens: torch.Tensor  # [windows, length] int64: the token windows
    first: int  # logits at positions first..length-2 are scored (they predict tokens first+1..)
    top_ids: torch.Tensor  # [windows, scored, k] int32, most likely first
    top_logprobs: torch.Tensor  # [windows, scored, k] f32
    rest_logprob: torch.Tensor  # [windows, scored] f32: log of the mass outside the top k (-inf: none)
    target_logprob: torch.Tensor  # [windows, scored] f32: log p of the token that follows
    vocab_size: int
    source: str = ""  # what produced it (an artifact path), for messages

    @property
    def top_k(self) -> int:
        return self.top_ids.shape[-1]

    @property
    def targets(self) -> torch.Tensor:
        """[windows, scored] the tokens each scored position predicts."""
        return self.tokens[:, self.first + 1 :]

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        save_file(
            {
                "tokens": self.tokens.contiguous(),
                "top_ids": self.top_ids.contiguous(),
                "top_logprobs": self.top_logprobs.contiguous(),
                "rest_logprob": self.rest_logprob.contiguous(),
                "target_logprob": self.target_logprob.contiguous(),
            },
            str(partial),
            metadata={
                "format": FORMAT,
                "first": str(self.first),
                "vocab_size": str(self.vocab_size),
                "source": self.source,
            },
        )
        partial.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> ReferenceLogits:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise QualityError(
                        f"{path} is not a Kiln reference-logits file (format {meta.get('format')!r}, "
                        f"expected {FORMAT!r}). Fix: write it with `kiln quality --save-reference`."
                    )
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, SafetensorError) as error:
            raise QualityError(
                f"cannot read reference logits {path}: {error}. Fix: pass a file written by "
                "`kiln quality --save-reference`, or the reference artifact itself."
            ) from None
        return cls(
            tensors["tokens"],
            int(meta["first"]),
            tensors["top_ids"],
            tensors["top_logprobs"],
            tensors["rest_logprob"],
            tensors["target_logprob"],
            int(meta["vocab_size"]),
            meta.get("source", ""),
        )


def default_first(length: int) -> int:
    """llama-perplexity's choice: the first half of a window is context only."""
    return length // 2


def check_windows(windows: torch.Tensor, first: int, max_seq_len: int) -> None:
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise QualityError(f"token windows must be [count, length >= 2], got {list(windows.shape)}")
    if not 0 <= first < windows.shape[1] - 1:
        raise QualityError(
            f"first scored position {first} is outside a window of {windows.shape[1]} tokens. "
            f"Fix: give a value from 0 to {windows.shape[1] - 2}."
        )
    if windows.shape[1] > max_seq_len:
        raise ContextLengthError(windows.shape[1], max_seq_len)


def scored_log_probs(executable, window: torch.Tensor, first: int) -> torch.Tensor:
    """Log-probabilities [scored, vocab] of the positions scored in one window: computed in f64,
    rounded to f32 (what a stored reference keeps, so that a model against itself gives exactly 0)."""
    logits = window_logits(executable, window)
    return torch.log_softmax(logits[first:-1].double(), dim=-1).float().double()


def log_rest(log_probs: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """log of the probability outside `top_ids` [scored, k] (summed over the other tokens rather
    than 1 - the top's, which cancels); -inf when the top covers the vocabulary. f32-rounded."""
    outside = log_probs.scatter(-1, top_ids.long(), float("-inf"))
    return torch.logsumexp(outside, dim=-1).float().double()


def reference_logits(
    executable, windows: torch.Tensor, first: int | None = None, top_k: int | None = DEFAULT_TOP_K, source: str = ""
) -> ReferenceLogits:
    """Run `executable` over `windows` [count, length] and keep what `quality.compare` needs;
    `top_k=None` keeps the whole distributions (exact KLD; 8 bytes per token of the vocabulary)."""
    first = default_first(windows.shape[1]) if first is None else first
    check_windows(windows, first, executable.options.max_seq_len)
    if top_k is not None and top_k < 1:
        raise QualityError(f"top_k must be at least 1, got {top_k}")
    ids, logprobs, rest, target = [], [], [], []
    vocab = None
    for window in windows:
        log_probs = scored_log_probs(executable, window, first)
        vocab = log_probs.shape[-1]
        top = torch.topk(log_probs, vocab if top_k is None else min(top_k, vocab), dim=-1)
        ids.append(top.indices.to(torch.int32))
        logprobs.append(top.values.float())
        rest.append(log_rest(log_probs, top.indices).float())
        target.append(log_probs.gather(-1, window[first + 1 :, None]).squeeze(-1).float())
    executable.reset()
    return ReferenceLogits(
        windows.to(torch.int64),
        first,
        torch.stack(ids),
        torch.stack(logprobs),
        torch.stack(rest),
        torch.stack(target),
        vocab,
        source,
    )


def truncated(reference: ReferenceLogits, top_k: int) -> ReferenceLogits:
    """The top `top_k` of a reference kept with a larger (or full) top; the rest summed exactly."""
    rest = torch.logaddexp(
        reference.rest_logprob.double(), torch.logsumexp(reference.top_logprobs[..., top_k:].double(), dim=-1)
    )
    return ReferenceLogits(
        reference.tokens,
        reference.first,
        reference.top_ids[..., :top_k].contiguous(),
        reference.top_logprobs[..., :top_k].contiguous(),
        rest.float(),
        reference.target_logprob,
        reference.vocab_size,
        reference.source,
    )


def cache_key(reference_manifest: bytes, windows: torch.Tensor, first: int, top_k: int) -> str:
    """A name for the reference logits of one artifact (its manifest pins its weights) on one text."""
    digest = hashlib.sha256(FORMAT.encode())
    digest.update(reference_manifest)
    digest.update(windows.to(torch.int64).contiguous().numpy().tobytes())
    digest.update(json.dumps([list(windows.shape), first, top_k]).encode())
    return digest.hexdigest()[:24]


def perplexity_of(logprobs: torch.Tensor) -> float:
    """exp of the mean negative log-likelihood."""
    return math.exp(-logprobs.double().mean().item())
