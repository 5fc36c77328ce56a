"""What one request is while it generates: `GenerationRequest` (what is asked) and `Row` (its
sampler, stop strings, constraint, text and counts). The engine (engine.py) owns the model calls
and feeds each Row the logits after its newest token.

A row with a constraint (json_schema / regex / choices, constraints.py) samples only tokens its
grammar allows and takes forced tokens without sampling. Fast-forward appends the forced tokens
ahead (`Row.push_forced`); the engine then feeds them with the row's newest token in one
multi-token call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.runtime.constraints import CompiledConstraint
from kiln.runtime.detokenizer import IncrementalDecoder
from kiln.runtime.sampler import Sampler, SamplingParams, TokenLogprob
from kiln.runtime.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class GenerationRequest:
    """What every prompt of a `generate` call (or one `submit`) is asked for."""

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
    """The state of one prompt while it generates.

    The engine calls `accept(logits)` with the logits after the row's newest token (the
    prompt's last at first): it samples (or takes the token a constraint forces) and appends it.
    With a constraint, `push_forced()` then appends the tokens the grammar forces next, without
    sampling; the engine feeds them with the newest token in one call and calls `accept` on the
    last logits. `model_steps` counts
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
