"""Turning a row of logits into the next token: greedy, or seeded sampling with the full suite
of processors (logits_processors.py): logit bias, repetition / presence / frequency penalties,
min_tokens and bad_words bans, temperature, top-k, top-p, min-p, typical and eta sampling;
optionally with log-probabilities.

Each request row owns a `Sampler` with its own `torch.Generator`, so the tokens a prompt gets
depend only on its logits, its context and its seed, never on what else shares the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from kiln.runtime import logits_processors as lp
from kiln.runtime.errors import GenerationError

# Below this temperature sampling is greedy: logits / 1e-45 overflow to inf, and the limit of
# sampling as the temperature falls is the argmax anyway (vLLM draws the line at the same place).
GREEDY_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0  # already all but uniform; far larger ones overflow float32 to inf
# A penalty p divides (or multiplies) a logit by p: beyond these the logits overflow float32,
# and well before them the penalty already bans (or forces) every token seen.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 (or below GREEDY_TEMPERATURE) is greedy (after bias
    and penalties); every other setting at its default disables its step. `logprobs` None
    returns none; n >= 0 returns the chosen token's log-probability and the n most likely
    alternatives, from the model's own distribution (before any processing).

    `min_tokens`: the end tokens (EOS and stop_token_ids) are banned until that many new tokens
    exist. `bad_words`: token id sequences never generated: a sequence's last token is banned
    wherever the context (prompt and output) ends with the tokens before it, as Hugging Face's
    `bad_words_ids` (a one-token sequence is banned everywhere)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    eta: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    logprobs: int | None = None
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = field(default=())

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias.items()))
        object.__setattr__(self, "bad_words", _token_sequences(self.bad_words))
        self._check_finite()
        low, high = REPETITION_PENALTY_RANGE
        checks = [
            (
                0 <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}. Fix: use 0 for greedy.",
            ),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}. Fix: use 0 to disable it."),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}. Fix: use 1.0 to disable it."),
            (0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}. Fix: use 0 to disable it."),
            (
                0.0 < self.typical_p <= 1.0,
                f"typical_p must be in (0, 1], got {self.typical_p}. Fix: use 1.0 to disable it.",
            ),
            (0.0 <= self.eta < 1.0, f"eta must be in [0, 1), got {self.eta}. Fix: use 0 to disable it."),
            (
                low <= self.repetition_penalty <= high,
                f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}. "
                "Fix: use 1.0 to disable it (above 1 discourages repeats, below 1 favours them).",
            ),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be None or >= 0, got {self.logprobs}."),
            (
                _is_count(self.min_tokens),
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r:.40}. Fix: use 0 to disable it.",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise GenerationError(message)

    def _check_finite(self) -> None:
        """inf or nan in any setting would reach the logits as inf or nan."""
        for setting in fields(self):
            value = getattr(self, setting.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise GenerationError(
                    f"{setting.name} must be a finite number, got {value}. "
                    "Fix: pass a number, or leave it out for its default."
                )
        for token, bias in self.logit_bias:
            if not math.isfinite(bias):
                raise GenerationError(
                    f"logit_bias for token {token} must be a finite number, got {bias}. "
                    "Fix: use -100 to ban a token, +100 to all but force it."
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_count(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def _token_sequences(sequences) -> tuple[tuple[int, ...], ...]:
    """bad_words as a tuple of non-empty token id tuples; GenerationError for anything else
    (text is turned into ids by `LLM.generate`, which has the tokenizer)."""
    problem = "bad_words must be a list of token id lists, e.g. [[464, 1110], [50256]]"
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, (list, tuple)):
        raise GenerationError(f"{problem}; got {sequences!r:.60}. Fix: pass lists of token ids (or words to generate).")
    checked = []
    for sequence in sequences:
        if (
            isinstance(sequence, (str, bytes))
            or not isinstance(sequence, (list, tuple))
            or not sequence
            or not all(_is_count(token) for token in sequence)
        ):
            raise GenerationError(
                f"{problem}; got {sequence!r:.60} among them. Fix: give each banned sequence as "
                "a non-empty list of token ids >= 0 (words go through LLM.generate)."
            )
        checked.append(tuple(int(token) for token in sequence))
    return tuple(checked)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token, its log-probability under the model, and the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every token outside `allowed` at -inf (in numpy: this thread, no torch pool)."""
    return torch.from_numpy(np.where(allowed.numpy(), logits.cpu().numpy(), np.float32(lp.NEG_INF)))


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [vocab] with every token outside the top-k / top-p (nucleus) set at -inf."""
    return lp.top_p(lp.top_k(logits, top_k), top_p)


class Sampler:
    """Picks tokens for one request row; seeded, so the same logits, context and seed give the
    same tokens."""

    def __init__(self, params: SamplingParams, seed: int = 0, end_ids: frozenset[int] = frozenset()):
        """`end_ids`: the tokens that end the output (EOS, stop_token_ids), which min_tokens bans."""
        self.params = params
        self.generator = torch.Generator().manual_seed(int(seed))
        self.end_ids = frozenset(end_ids)
        # Greedy with nothing to adjust the logits and no log-probabilities: the argmax alone
        p = params
        self._argmax_only = (
            p.greedy
            and not p.logit_bias
            and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0
            and p.logprobs is None
            and not self._bans_tokens
        )

    @property
    def _bans_tokens(self) -> bool:
        return bool(self.params.bad_words) or (self.params.min_tokens > 0 and bool(self.end_ids))

    def __call__(self, logits: torch.Tensor, prompt: Sequence[int] = (), generated: Sequence[int] = ()) -> int:
        """The next token id for logits [vocab] after `prompt` and the tokens `generated` so far."""
        return self.choose(logits, prompt, generated).token

    def choose(
        self,
        logits: torch.Tensor,
        prompt: Sequence[int] = (),
        generated: Sequence[int] = (),
        allowed: torch.Tensor | None = None,
    ) -> TokenLogprob:
        """The next token; `allowed` (bool [vocab]) masks the rest to -inf first (a constraint),
        so top-k and the other filters pick among allowed tokens. Log-probabilities stay the model's."""
        if self._argmax_only and allowed is None and logits.dtype == torch.float32:
            # numpy only: after a model step has streamed its weights through the caches, every
            # distinct torch op pays cold-cache misses in its dispatcher (~0.1 ms per token, measured)
            return TokenLogprob(int(logits.numpy().argmax()), 0.0)
        raw = logits.detach().float().reshape(-1)
        masked = raw if allowed is None else _mask(raw, allowed)
        processed = self.process(masked, prompt, generated)
        if self.params.greedy:
            # numpy's argmax runs in this thread: torch's splits a vocab-sized reduction over its
            # OpenMP pool, whose spinning workers then steal cores from the backend's own threads
            token = int(processed.numpy().argmax())
        else:
            probs = torch.softmax(processed, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        return self._with_logprobs(raw, token)

    def score(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """The record of a token chosen without sampling (a constraint forced it)."""
        return self._with_logprobs(logits.detach().float().reshape(-1), token)

    def process(self, logits: torch.Tensor, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
        """The logits a token is drawn from (greedy takes their argmax)."""
        p = self.params
        if p.logit_bias:
            logits = lp.add_logit_bias(logits, dict(p.logit_bias))
        if p.repetition_penalty != 1.0:  # skipped, not only neutral: it would walk the whole context
            logits = lp.repetition_penalty(logits, [*prompt, *generated], p.repetition_penalty)
        logits = lp.presence_frequency_penalty(logits, generated, p.presence_penalty, p.frequency_penalty)
        logits = self.ban(logits, prompt, generated)
        if p.greedy:
            return logits
        logits = logits / p.temperature
        for step, setting in (
            (lp.top_k, p.top_k),
            (lp.top_p, p.top_p),
            (lp.min_p, p.min_p),
            (lp.typical, p.typical_p),
            (lp.eta, p.eta),
        ):
            logits = step(logits, setting)
        return logits

    def ban(self, scores: torch.Tensor, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
        """`scores` [vocab] (logits or log-probabilities) with the tokens min_tokens and bad_words
        forbid after this context at -inf."""
        p = self.params
        banned = set(self.end_ids) if len(generated) < p.min_tokens else set()
        if p.bad_words:
            banned |= lp.bad_word_bans(p.bad_words, prompt, generated)
        return lp.ban_tokens(scores, banned)

    def _with_logprobs(self, raw: torch.Tensor, token: int) -> TokenLogprob:
        if self.params.logprobs is None:
            return TokenLogprob(token, 0.0)
        log_probs = torch.log_softmax(raw, dim=-1)
        top = torch.topk(log_probs, min(self.params.logprobs, log_probs.numel())) if self.params.logprobs else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        return TokenLogprob(token, float(log_probs[token]), alternatives)
