"""The generation loop for one batch of prompts against an Executable.

One prefill call runs every prompt at once, right-padded to the longest: row b's tokens sit at
positions 0..T-1, and its first new token comes from the logits at index len_b - 1. The padding
writes junk into cache slots len_b..T-1 of row b, which is harmless: a query at position p sees
only slots <= p, and row b's decode steps (positions len_b, len_b + 1, ...) overwrite each junk
slot before any query can see it. The same argument covers junk left by earlier requests, so
the caches need no reset between requests.

Rows that finish early (EOS, a stop string, their token limit) keep being fed their last token
at their last valid slot, so the batch stays rectangular until every row is done.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kiln.runtime.detokenizer import IncrementalDecoder
from kiln.runtime.results import GenerationResult, GenerationStats
from kiln.runtime.sampler import Sampler, SamplingParams
from kiln.runtime.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class GenerationRequest:
    """What every prompt of a batch is asked for."""

    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()  # end like EOS, with finish_reason "stop"


def max_new_tokens_that_fit(prompt_len: int, requested: int, max_seq_len: int) -> int:
    """Every token fed to the model needs a cache slot; the last new token is never fed, so a
    prompt of length L can get up to max_seq_len - L + 1 new tokens."""
    return max(0, min(requested, max_seq_len - prompt_len + 1))


class Row:
    """The state of one prompt while its batch runs."""

    def __init__(self, prompt: list[int], request: GenerationRequest, seed: int, max_seq_len: int, decoder):
        self.prompt = prompt
        self.max_new = max_new_tokens_that_fit(len(prompt), request.max_new_tokens, max_seq_len)
        self.clamped = self.max_new < request.max_new_tokens
        self.eos_ids = request.eos_ids
        self.stop_token_ids = request.stop_token_ids
        self.logprobs = [] if request.sampling.logprobs is not None else None
        self.seed = seed
        self.sampler = Sampler(request.sampling, seed)
        self.decoder: IncrementalDecoder | None = decoder
        self.stop = StopStringMatcher(request.stop)
        self.tokens: list[int] = []
        self.text = ""
        self.position = len(prompt)  # the cache slot the next fed token goes to
        self.finish_reason: str | None = None if self.max_new > 0 else ("context" if self.clamped else "length")
        self.decode_s = 0.0

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    def accept(self, logits: torch.Tensor) -> str:
        """Sample the next token from logits [vocab]; return the text it completes."""
        return self.push(self.sampler.choose(logits, self.prompt, self.tokens))

    def push(self, choice) -> str:
        """Append a chosen token (a TokenLogprob); return the text it completes."""
        token = choice.token
        self.tokens.append(token)
        if self.logprobs is not None:
            self.logprobs.append(choice)
        piece = ""
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif token in self.stop_token_ids:
            self.finish_reason = "stop"
        else:
            if self.decoder is not None:
                piece = self.stop.push(self.decoder.push(token))
            if self.stop.stopped:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_new:
                self.finish_reason = "context" if self.clamped else "length"
        if not self.active:
            piece += self._remaining_text()
        self.text += piece
        return piece

    def _remaining_text(self) -> str:
        if self.decoder is None or self.finish_reason == "stop":
            return ""
        piece = self.stop.push(self.decoder.finish())
        if self.stop.stopped:
            self.finish_reason = "stop"
        return piece + self.stop.flush()


class BatchGeneration:
    """Iterate to run the batch, getting (row index, text piece) as text completes; then read
    `results`. Timings count only model calls and sampling, not the time a consumer of the
    stream spends between pieces."""

    def __init__(self, executable, prompts: Sequence[list[int]], request: GenerationRequest,
                 seeds: Sequence[int], decoder_factory=None):
        self.executable = executable
        self.max_seq_len = executable.options.max_seq_len
        self.request, self.decoder_factory = request, decoder_factory
        self.rows = [Row(list(p), request, s, self.max_seq_len, decoder_factory() if decoder_factory else None)
                     for p, s in zip(prompts, seeds)]
        self.prefill_s = 0.0

    def __iter__(self) -> Iterator[tuple[int, str]]:
        if not any(r.active for r in self.rows):
            return
        start = time.perf_counter()
        pieces = self._prefill()
        self.prefill_s = time.perf_counter() - start
        yield from ((b, p) for b, p in enumerate(pieces) if p)
        while any(r.active for r in self.rows):
            start = time.perf_counter()
            pieces = self._decode_step()
            elapsed = time.perf_counter() - start
            for row, piece in zip(self.rows, pieces):
                if piece is not None:
                    row.decode_s += elapsed
            yield from ((b, p) for b, p in enumerate(pieces) if p)

    def _prefill(self) -> list[str]:
        lengths = [len(r.prompt) for r in self.rows]
        tokens = torch.zeros(len(self.rows), max(lengths), dtype=torch.int64)
        for b, row in enumerate(self.rows):
            tokens[b, :lengths[b]] = torch.tensor(row.prompt, dtype=torch.int64)
        positions = torch.arange(max(lengths), dtype=torch.int64).expand_as(tokens).contiguous()
        logits = self.executable.run(tokens, positions)
        return [row.accept(logits[b, lengths[b] - 1]) if row.active else "" for b, row in enumerate(self.rows)]

    def _decode_step(self) -> list[str | None]:
        """Feed each row its newest token; a piece per row (None for rows already finished)."""
        tokens = torch.tensor([[r.tokens[-1] if r.tokens else r.prompt[-1]] for r in self.rows], dtype=torch.int64)
        positions = torch.tensor([[min(r.position, self.max_seq_len - 1)] for r in self.rows], dtype=torch.int64)
        logits = self.executable.run(tokens, positions)
        pieces: list[str | None] = []
        for b, row in enumerate(self.rows):
            if row.active:
                row.position += 1
                pieces.append(row.accept(logits[b, 0]))
            else:
                pieces.append(None)
        return pieces

    def results(self) -> list[GenerationResult]:
        """One result per prompt, after the iteration has finished."""
        return [GenerationResult(
            text=row.text, token_ids=list(row.tokens), finish_reason=row.finish_reason or "length",
            prompt_token_ids=list(row.prompt), logprobs=row.logprobs,
            stats=GenerationStats(tokens_in=len(row.prompt), tokens_out=len(row.tokens), ttft_s=self.prefill_s,
                                  prefill_s=self.prefill_s, decode_s=row.decode_s,
                                  max_new_tokens=row.max_new, clamped=row.clamped),
        ) for row in self.rows]
