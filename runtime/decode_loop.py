"""The generation loop for one batch of prompts against an Executable.

One prefill call runs every prompt at once, right-padded to the longest: row b's tokens sit at
positions 0..T-1, and its first new token comes from the logits at index len_b - 1. The padding
writes junk into cache slots len_b..T-1 of row b, which is harmless: a query at position p sees
only slots <= p, and row b's decode steps (positions len_b, len_b + 1, ...) overwrite each junk
slot before any query can see it. The same argument covers junk left by earlier requests, so
the caches need no reset between requests.

Rows that finish early (EOS, a stop string, their token limit) keep being fed their last token
at their last valid slot, so the batch stays rectangular until every row is done.

A row with a constraint (json_schema / regex / choices, constraints.py) samples only tokens its
grammar allows and takes forced tokens without sampling. Fast-forward appends the forced tokens
ahead (`Row.push_forced`) and feeds them with the row's newest token in one multi-token call:
in the prefill (appended to the prompt) for every row, and in a decode step as a call of its own
(at its cache row via `first_row` when the batch has several rows, where the executable takes it).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kiln.runtime.constraints import CompiledConstraint
from kiln.runtime.detokenizer import IncrementalDecoder
from kiln.runtime.results import GenerationResult, GenerationStats
from kiln.runtime.sampler import Sampler, SamplingParams, TokenLogprob
from kiln.runtime.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class GenerationRequest:
    """What every prompt of a batch is asked for."""

    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()  # end like EOS, with finish_reason "stop"
    constraint: CompiledConstraint | None = None  # json_schema / regex / choices (constraint_compiler.py)


def max_new_tokens_that_fit(prompt_len: int, requested: int, max_seq_len: int) -> int:
    """Every token fed to the model needs a cache slot; the last new token is never fed, so a
    prompt of length L can get up to max_seq_len - L + 1 new tokens."""
    return max(0, min(requested, max_seq_len - prompt_len + 1))


class Row:
    """The state of one prompt while its batch runs.

    A decode loop calls `accept(logits)` with the logits after the row's newest token (the
    prompt's last at first): it samples (or takes the token a constraint forces) and appends it.
    With a constraint, `push_forced()` then appends the tokens the grammar forces next, without
    sampling; the loop feeds them with the newest token in one call, at positions
    `position .. position + n`, and calls `accept` on the last logits. `model_steps` counts
    `accept` calls (the model calls whose logits the row used), `forced_count` the forced tokens.
    """

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
        self.constraint = request.constraint.start() if request.constraint is not None else None
        self.model_steps = 0
        self.forced_count = 0

    @property
    def active(self) -> bool:
        return self.finish_reason is None

    def accept(self, logits: torch.Tensor) -> str:
        """Sample the next token from logits [vocab] (among the tokens a constraint allows, or
        the one it forces); return the text it completes."""
        self.model_steps += 1
        if self.constraint is None:
            return self.push(self.sampler.choose(logits, self.prompt, self.tokens))
        forced = self.constraint.forced(1)
        if forced:
            return self.push(self.sampler.score(logits, forced[0]))
        allowed = self.constraint.allowed(logits.shape[-1])
        return self.push(self.sampler.choose(logits, self.prompt, self.tokens, allowed=allowed))

    def forced_tokens(self) -> list[int]:
        """The tokens the constraint forces next, within the row's token budget: what
        `push_forced` would append. Empty without a constraint, when fast-forward is off, or when
        log-probabilities were asked for (forced tokens then come one decode step each, scored)."""
        if self.constraint is None or not self.constraint.fast_forward or self.logprobs is not None or not self.active:
            return []
        return self.constraint.forced(self.max_new - len(self.tokens))

    def push_forced(self) -> str:
        """Append `forced_tokens()` without sampling; return the text they complete. The caller
        feeds them (they have no keys and values yet)."""
        return "".join(self.push(TokenLogprob(token, 0.0)) for token in self.forced_tokens() if self.active)

    def push(self, choice) -> str:
        """Append a chosen token (a TokenLogprob); return the text it completes."""
        token = choice.token
        if self.constraint is not None and self.constraint.advance(token):
            self.forced_count += 1
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
            elif self.constraint is not None and self.constraint.complete:
                piece += self._remaining_text()  # before finishing: "stop" would drop the held text
                self.finish_reason = self.finish_reason or "stop"
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
        # a decode step feeds a row's forced tokens in a call of its own: at its cache row
        self.fast_forward = len(self.rows) == 1 or _takes_first_row(executable)

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
        """One call for every prompt, each followed by the tokens its constraint forces first."""
        pieces = [row.push_forced() for row in self.rows]
        feeds = [row.prompt + row.tokens if row.active else row.prompt for row in self.rows]
        if not any(row.active for row in self.rows):
            return pieces
        lengths = [len(feed) for feed in feeds]
        tokens = torch.zeros(len(self.rows), max(lengths), dtype=torch.int64)
        for b, feed in enumerate(feeds):
            tokens[b, :lengths[b]] = torch.tensor(feed, dtype=torch.int64)
        positions = torch.arange(max(lengths), dtype=torch.int64).expand_as(tokens).contiguous()
        logits = self.executable.run(tokens, positions)
        for b, row in enumerate(self.rows):
            if row.active:
                row.position = lengths[b]  # the newest token's slot, after the prompt and forced tokens
                pieces[b] += row.accept(logits[b, lengths[b] - 1])
        return pieces

    def _decode_step(self) -> list[str | None]:
        """Feed each row its newest token (and the tokens forced after it); a piece per row (None
        for rows already finished)."""
        pieces: list[str | None] = [None] * len(self.rows)
        ahead = {b: 0 for b, row in enumerate(self.rows) if row.active}  # forced tokens appended now
        if self.fast_forward:
            for b in ahead:
                before = len(self.rows[b].tokens)
                pieces[b] = self.rows[b].push_forced()
                ahead[b] = len(self.rows[b].tokens) - before
        own_call = [b for b, n in ahead.items() if n and self.rows[b].active]
        batched = [b for b in ahead if self.rows[b].active and b not in own_call]
        if batched:
            newest = [row.tokens[-1 - ahead.get(b, 0)] if row.tokens else row.prompt[-1]
                      for b, row in enumerate(self.rows)]
            tokens = torch.tensor([[t] for t in newest], dtype=torch.int64)
            positions = torch.tensor([[min(r.position, self.max_seq_len - 1)] for r in self.rows], dtype=torch.int64)
            logits = self.executable.run(tokens, positions)
            for b in batched:
                self.rows[b].position += 1
                pieces[b] = (pieces[b] or "") + self.rows[b].accept(logits[b, 0])
        for b in own_call:
            pieces[b] += self._feed_forced(b, ahead[b])
        return pieces

    def _feed_forced(self, b: int, n: int) -> str:
        """Feed row b's newest sampled token and the n forced after it in one call; accept the next."""
        row = self.rows[b]
        feed = torch.tensor([row.tokens[-1 - n:]], dtype=torch.int64)
        positions = torch.arange(row.position, row.position + n + 1, dtype=torch.int64)[None]
        extra = {"first_row": b} if len(self.rows) > 1 else {}
        logits = self.executable.run(feed, positions, **extra)
        row.position += n + 1
        return row.accept(logits[0, -1])

    def results(self) -> list[GenerationResult]:
        """One result per prompt, after the iteration has finished."""
        return [GenerationResult(
            text=row.text, token_ids=list(row.tokens), finish_reason=row.finish_reason or "length",
            prompt_token_ids=list(row.prompt), logprobs=row.logprobs,
            stats=GenerationStats(tokens_in=len(row.prompt), tokens_out=len(row.tokens), ttft_s=self.prefill_s,
                                  prefill_s=self.prefill_s, decode_s=row.decode_s,
                                  max_new_tokens=row.max_new, clamped=row.clamped,
                                  model_steps=row.model_steps, forced_tokens=row.forced_count),
        ) for row in self.rows]


def _takes_first_row(executable) -> bool:
    """Whether `executable.run` can address one cache row (`first_row`)."""
    try:
        return "first_row" in inspect.signature(executable.run).parameters
    except (TypeError, ValueError):
        return False
