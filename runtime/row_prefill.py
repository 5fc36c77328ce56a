"""Prefilling one prompt into KV row 0 a chunk at a time, for the generations that hold the
executable alone (beam and contrastive search): a long prompt's logits are never all in memory
at once (2,048 positions x 49,152 vocabulary entries of f32 are 400 MB)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.runtime.engine import PREFILL_CHUNK

CHUNK = PREFILL_CHUNK  # prompt tokens per model call


def prefill_row0(
    executable, prompt: list[int], each_chunk: Callable[[torch.Tensor], None] | None = None
) -> torch.Tensor:
    """Feed `prompt` into row 0; return the f32 logits [vocab] after its last token (on the host).
    `each_chunk` gets every chunk's logits [chunk, vocab]; without it only the last position's
    are computed where the executable can skip the rest."""
    last_only = {"last_only": True} if each_chunk is None and getattr(executable, "selects_logits", False) else {}
    logits = None
    for start in range(0, len(prompt), CHUNK):
        tokens = prompt[start : start + CHUNK]
        logits = (
            executable.run(torch.tensor([tokens]), torch.arange(start, start + len(tokens))[None], **last_only)[0]
            .float()
            .cpu()
        )
        if each_chunk is not None:
            each_chunk(logits)
    return logits[-1]
