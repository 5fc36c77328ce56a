"""Errors the runtime raises: each names the problem and the fix.

They derive from `KilnError` (defined in `kiln.ir.errors`, which every stage may import), so
`except kiln.KilnError` catches every one of them.
"""

from __future__ import annotations

from kiln.ir.errors import ArtifactError, KilnError  # noqa: F401  (re-exported: backends raise it too)


class TokenizerError(KilnError):
    """The tokenizer files are missing or unusable, or there is no chat template."""


class GenerationError(KilnError):
    """A generation request cannot be served as asked (bad prompt or sampling settings)."""


class ContextLengthError(GenerationError):
    """A prompt does not fit in the context the artifact was compiled for.

    Attributes:
        prompt_tokens: the prompt's length in tokens.
        max_seq_len: the compiled limit.
    """

    def __init__(self, prompt_tokens: int, max_seq_len: int, index: int | None = None, kind: str = "prompt") -> None:
        self.prompt_tokens = prompt_tokens
        self.max_seq_len = max_seq_len
        which = f"The {kind}" if index is None else f"{kind.capitalize()} {index}"
        super().__init__(
            f"{which} has {prompt_tokens} tokens but the artifact was compiled with "
            f"max_seq_len={max_seq_len}. Fix: shorten the {kind}, or recompile with "
            f"`--max-seq-len {_next_power_of_two(prompt_tokens + 1)}` or more."
        )


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class QueueFullError(GenerationError):
    """The engine's waiting queue is at its bound: the request was not queued."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        super().__init__(
            f"{max_queue} requests are already waiting for a KV slot. Fix: retry later, or "
            "raise the engine's max_queue (kiln serve --max-queue)."
        )


class ConstraintError(GenerationError):
    """A json_schema / regex / choices constraint is malformed, or no output can satisfy it."""


class TokenIdError(GenerationError, ValueError):
    """A token id (of a prompt, stop_token_ids or logit_bias) is outside the model's vocabulary.

    Attributes:
        token_id: the bad id.
        field: where it was given: "the prompt", "prompt 2" (of a list), "stop_token_ids", "logit_bias".
        position: its index there (None for logit_bias, a mapping).
        vocab_size: the model's vocabulary size (valid ids are 0 .. vocab_size - 1).
    """

    def __init__(self, token_id: int, field: str, position: int | None, vocab_size: int | None) -> None:
        self.token_id, self.field, self.position, self.vocab_size = token_id, field, position, vocab_size
        where = f"in {field}" if position is None else f"at position {position} of {field}"
        valid = f"0..{vocab_size - 1}" if vocab_size else "0..2**63-1"
        super().__init__(
            f"Token id {token_id} {where} is not in this model's vocabulary (valid ids: {valid}). "
            "Fix: pass token ids from the model's own tokenizer."
        )
