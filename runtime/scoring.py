"""Scoring given text: the log-probability of each token of a continuation under the model.

    scores = llm.score("The capital of France is", " Paris.")
    scores.token_logprobs   # one per continuation token, natural log
    scores.total            # their sum: log p(continuation | prompt)

What RLHF's policy step needs (each sample scored under the policy and under the reference
model), and what a server's `echo` + `logprobs` returns. The text runs through the model in
prefill chunks from position 0 of KV row 0, all positions' logits kept, while the engine holds
no other request (`Engine.exclusive`); log-softmax is taken in float64 on the model's f32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.errors import ContextLengthError, GenerationError

SCORE_CHUNK = 128  # tokens per model call, as the engine's prefill chunk


@dataclass(frozen=True)
class TokenScores:
    """A continuation's tokens, their log-probabilities, and optionally the top alternatives."""

    token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None = None  # per token: the `top_n` likeliest ids

    @property
    def total(self) -> float:
        return sum(self.token_logprobs)

    @property
    def mean(self) -> float:
        return self.total / len(self.token_logprobs) if self.token_logprobs else 0.0


def score_tokens(
    executable, prompt: list[int], continuation: list[int], top_n: int = 0, chunk: int | None = None
) -> TokenScores:
    """Log-probabilities of `continuation`'s tokens after `prompt` (at least one token: the first
    token of a text has no prediction to score). The caller holds the executable alone."""
    if not prompt:
        raise GenerationError(
            "Scoring needs at least one prompt token (the first token of a text is not "
            "predicted). Fix: put the text's first token (or a BOS token) in the prompt."
        )
    if not continuation:
        raise GenerationError("The continuation to score is empty. Fix: give at least one token to score.")
    if top_n < 0:
        raise GenerationError(f"top_n must be >= 0, got {top_n}. Fix: pass 0 (none) or how many alternatives.")
    ids = list(prompt) + list(continuation)
    if len(ids) > executable.options.max_seq_len:
        raise ContextLengthError(len(ids), executable.options.max_seq_len)
    chosen, top = [], [] if top_n else None
    for log_probs, targets in _log_probs_of(executable, ids, first=len(prompt) - 1, chunk=chunk or SCORE_CHUNK):
        chosen += log_probs.gather(-1, targets[:, None]).squeeze(-1).tolist()
        if top_n:
            values, indices = log_probs.topk(min(top_n, log_probs.shape[-1]), dim=-1)
            top += [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
    return TokenScores(list(continuation), chosen, top)


def _log_probs_of(executable, ids: list[int], first: int, chunk: int):
    """(log-softmax [n, vocab], the n tokens they predict) per model call, for the predictions of
    ids[first + 1:]: ids run through KV row 0 `chunk` tokens a call (the last one predicts nothing
    to score, so it is not fed)."""
    tokens = torch.tensor(ids, dtype=torch.int64)
    with torch.no_grad():
        for start in range(0, len(ids) - 1, chunk):
            end = min(start + chunk, len(ids) - 1)
            logits = executable.run(tokens[None, start:end], torch.arange(start, end)[None])[0]
            keep = max(first - start, 0)
            if keep < end - start:
                yield torch.log_softmax(logits[keep:].double(), dim=-1), tokens[start + keep + 1 : end + 1]
