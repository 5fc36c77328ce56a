"""`echo` on /v1/completions: the prompt returned before each choice's text, and with `logprobs`
the log-probability of every prompt token, as OpenAI's API gives them (the first token's is
null: nothing predicts it). This is how a client scores given text (`max_tokens: 0`).

The prompt's log-probabilities come from `score_tokens` (runtime/scoring.py: every position's
logits through KV row 0) while the engine runs no other request, so a scored request waits for
the engine to be idle. Its top alternatives are the `logprobs` likeliest, as for generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.scoring import TokenScores, score_tokens


@dataclass(frozen=True)
class EchoedPrompt:
    """The prompt as the answer echoes it: its text, token ids, and the scores of every token
    after the first (None when not asked for, or for a one-token prompt)."""

    text: str
    token_ids: list[int]
    scores: TokenScores | None = None


def echoed_prompt(llm, prompt, prompt_ids: list[int], logprobs: int | None) -> EchoedPrompt:
    """The echo of `prompt` (the request's text, or token ids: decoded), scored when `logprobs` is
    not None. Blocks until the engine is idle (run it off the event loop)."""
    scores = None
    if logprobs is not None and len(prompt_ids) > 1:
        with llm.engine.exclusive() as executable:
            scores = score_tokens(executable, prompt_ids[:1], prompt_ids[1:], top_n=logprobs)
    return EchoedPrompt(prompt_text(llm, prompt), list(prompt_ids), scores)


def prompt_text(llm, prompt) -> str:
    """The prompt's text: as sent, or its token ids decoded (no text without a tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    return llm.tokenizer.decode(prompt) if llm.tokenizer is not None else ""
