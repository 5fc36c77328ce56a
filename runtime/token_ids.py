"""Token ids checked against the model's vocabulary where they enter (prompts, stop_token_ids,
logit_bias keys), before any model call.

A model call must never see an id outside the embedding table: Inductor's generated C++ raises
c10::Error from inside the kernel (which aborted a server over SmolLM2), the reference backend
raises IndexError, and ONNX Runtime's Gather wraps negative ids around without a word. So every
id is checked once, where it enters, at the cost of one min/max pass over the prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kiln.runtime.errors import TokenIdError

INT64_LIMIT = 2**63  # torch.tensor of a larger id overflows before any model call


def model_vocab_size(executable, graph=None, tokenizer=None) -> int | None:
    """How many token ids the model takes: the width of its logits (the embedding covers the
    same ids), read from its graph or the backend's own record; the tokenizer's size if
    neither says; None when nothing does."""
    for candidate in (getattr(executable, "graph", None), graph):
        width = _logits_width(candidate)
        if width is not None:
            return width
    info = getattr(executable, "info", None)  # the ONNX Runtime executable's record of its model
    if isinstance(info, dict) and isinstance(info.get("vocab"), int):
        return info["vocab"]
    return tokenizer.vocab_size if tokenizer is not None else None


def _logits_width(graph) -> int | None:
    outputs = getattr(graph, "outputs", None)
    if not outputs:
        return None
    width = outputs[0].type.shape[-1]
    return width if isinstance(width, int) else None


def check_token_ids(ids: Sequence[int], vocab_size: int | None, field: str) -> None:
    """Raise TokenIdError for the first id of `ids` outside [0, vocab_size). One min/max pass
    in C when all are valid; the position is looked for only on failure."""
    if not ids:
        return
    upper = vocab_size or INT64_LIMIT
    if min(ids) >= 0 and max(ids) < upper:
        return
    position, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < upper)
    raise TokenIdError(token, field, position, vocab_size)


def check_token_set(ids: Iterable[int], vocab_size: int | None, field: str) -> None:
    """check_token_ids for ids without an order (a set, a mapping's keys): the error names no position."""
    upper = vocab_size or INT64_LIMIT
    for token in ids:
        if not 0 <= token < upper:
            raise TokenIdError(token, field, None, vocab_size)


def check_request_ids(prompt: Sequence[int], settings, vocab_size: int | None) -> None:
    """Every id a request for `prompt` with `settings` names: the prompt's, stop_token_ids, logit_bias
    keys, bad_words."""
    check_token_ids(prompt, vocab_size, "the prompt")
    check_token_set(settings.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_set((token for token, _ in settings.sampling.logit_bias), vocab_size, "logit_bias")
    check_token_set((token for sequence in settings.sampling.bad_words for token in sequence), vocab_size, "bad_words")


def known_prefix(tokens: Sequence[int], vocab_size: int | None) -> int:
    """How many leading tokens are ids of a model with `vocab_size` ids (a draft is cut there)."""
    upper = vocab_size or 2**63
    return next((i for i, token in enumerate(tokens) if not 0 <= token < upper), len(tokens))
