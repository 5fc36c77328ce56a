"""Rewards: a reward model's scalar score of whole texts.

    rm = kiln.load("reward.kiln")       # compiled from a *ForSequenceClassification checkpoint
    rm.reward("The answer is Paris.")   # -> float
    rm.reward([text_a, text_b])         # -> [float, float]

A reward artifact's graph gives every position's score where a causal LM's gives logits
(frontend/capture.py). A text's reward is the score at the position Hugging Face's sequence
classifiers pool: the text's last token that is not the pad token (its last token when the model
has no pad token; its first when every token is a pad). Scores at a position depend only on the
tokens up to it, so the text is fed only that far: through KV row 0 in prefill chunks, while the
engine holds no other request (`Engine.exclusive`), as `llm.score` feeds text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.runtime.errors import ContextLengthError, GenerationError

REWARD_CHUNK = 128  # tokens per model call, as the engine's prefill chunk


def is_reward_artifact(manifest: dict) -> bool:
    """Whether an artifact's manifest says it holds a reward model."""
    return manifest.get("task") == "reward"


def pooled_position(ids: Sequence[int], pad_token_id: int | None) -> int:
    """The index whose score is the text's reward, by Hugging Face's rule (see the docstring)."""
    if pad_token_id is None:
        return len(ids) - 1
    return max((i for i, token in enumerate(ids) if token != pad_token_id), default=0)


def check_reward_ids(ids: Sequence[int], max_seq_len: int, index: int | None = None) -> None:
    """GenerationError for an empty text, ContextLengthError for one longer than the compiled context."""
    which = "The text" if index is None else f"Text {index}"
    if not ids:
        raise GenerationError(f"{which} to reward is empty. Fix: give at least one token of text.")
    if len(ids) > max_seq_len:
        raise ContextLengthError(len(ids), max_seq_len, index, kind="text")


def reward_of(executable, ids: Sequence[int], pad_token_id: int | None, chunk: int | None = None) -> float:
    """The reward of one text's token ids (checked by the caller); the caller holds the executable alone."""
    end = pooled_position(ids, pad_token_id) + 1
    chunk = chunk or REWARD_CHUNK
    tokens = torch.tensor(list(ids[:end]), dtype=torch.int64)
    with torch.no_grad():
        for start in range(0, end, chunk):
            stop = min(start + chunk, end)
            scores = executable.run(tokens[None, start:stop], torch.arange(start, stop)[None])
    return float(scores[0, -1, 0])
