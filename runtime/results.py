"""What a generation returns: the text, the new token ids, why it ended and how fast it ran."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.sampler import TokenLogprob


@dataclass
class GenerationStats:
    """Timing and counts for one prompt. Rates are per prompt (its own tokens over the batch's
    wall time), so a batch of prompts reports each prompt's share, not the batch total.
    `ttft_s` runs from the request's submission (queueing included) to its first token
    (tokenizing not included).

    `max_new_tokens` is the limit actually applied: lower than asked when the prompt plus the
    requested tokens would not fit in the compiled context (then `clamped` is True).
    """

    tokens_in: int = 0
    tokens_out: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    max_new_tokens: int = 0
    clamped: bool = False
    cached_tokens: int = 0  # prompt tokens whose keys/values were reused from the prefix cache
    # model calls whose logits this prompt used (prefill included), and the tokens a constraint
    # forced (taken without sampling; fast-forward feeds them several to a call)
    model_steps: int = 0
    forced_tokens: int = 0
    # speculative decoding only: target-model steps after prefill, drafts proposed and accepted
    target_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    tokens_per_target_step: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def steps_per_token(self) -> float:
        """Model calls per new token: 1 for plain decoding, less with fast-forward."""
        return self.model_steps / self.tokens_out if self.tokens_out else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tokens_in / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which prefill produced) over the decode time."""
        return (self.tokens_out - 1) / self.decode_s if self.decode_s > 0 and self.tokens_out > 1 else 0.0

    def summary(self) -> str:
        """One line for humans: counts, TTFT and tokens/s."""
        line = (
            f"{self.tokens_in} prompt tokens, {self.tokens_out} new tokens | TTFT {self.ttft_s * 1000:.1f} ms | "
            f"prefill {self.prefill_tokens_per_s:.1f} tok/s | decode {self.decode_tokens_per_s:.1f} tok/s"
        )
        if self.target_steps:
            line += (
                f" | speculative: {self.acceptance_rate:.0%} of drafts accepted, "
                f"{self.tokens_per_target_step:.2f} tokens per target step"
            )
        return line + (f" | clamped to {self.max_new_tokens} new tokens by max_seq_len" if self.clamped else "")


@dataclass
class GenerationResult:
    """One prompt's generation.

    `token_ids` are the new tokens only, including the EOS (or stop) token when one ended it (the
    text never shows it). `finish_reason` is "eos", "stop" (a stop string, the text ending before
    it, a stop token id, or a json_schema / regex / choices constraint that admits nothing more),
    "length" (max_new_tokens) or "context" (the compiled max_seq_len clamped the length).
    """

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
