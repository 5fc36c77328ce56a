"""`ReplyIndex`: drafts from the model's own earlier replies, looked up by the context's last tokens.

Prompt lookup drafts what followed the newest tokens earlier in the request's own context; this
looks in a store of what the model said before. `kiln train-speculator` keeps the replies it
collected (the model's greedy answers to its chat prompts, some 260k tokens for SmolLM2) in the
artifact beside the heads (`speculator.replies.safetensors`, hashed in the manifest). A small
model's replies repeat their phrasing ("As the last light of the day faded, ..."), so where the
context's last few tokens occurred in them, what followed is often what the model says next: as
REST (He et al. 2024) drafts from a datastore, with the model's own text for the store. On the
prose prompt of bench/speculative.py such drafts alone accept about as many tokens per target
step as the heads' chain, and on other tokens than the heads do (docs/generation.md).

Lookup: the longest suffix of the context, of `max_ngram` tokens down to `min_ngram`, that
occurs in the store; its most frequent continuations (counted over at most `MAX_MATCHES` of its
occurrences) become the branches of a small token tree. Each n-gram length keeps the stream's
positions sorted by the n-gram's hash, so a lookup is a binary search per length; the index is
built when heads+lookup first runs (under half a second for SmolLM2's 258k reply tokens).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kiln.runtime.draft_tree import DraftTree

REPLIES_FILE = "speculator.replies.safetensors"
SEPARATOR = -1  # between replies in the stored stream: no n-gram or continuation crosses it
MAX_MATCHES = 256  # occurrences whose continuations are counted (evenly spread over them)
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # an odd 64-bit constant: the n-gram hash's base (arithmetic wraps)


class ReplyIndex:
    def __init__(
        self, stream: torch.Tensor, max_ngram: int = 6, min_ngram: int = 1, length: int = 4, branches: int = 3
    ):
        self.stream = stream.numpy().astype(np.int64)
        self.max_ngram, self.min_ngram, self.length, self.branches = max_ngram, min_ngram, length, branches
        self._sorted = {n: _sorted_ngrams(self.stream, n) for n in range(min_ngram, max_ngram + 1)}

    def continuations(self, context: Sequence[int]) -> list[list[int]]:
        """The most frequent continuations (up to `branches`, each up to `length` tokens) of the
        longest suffix of `context` found in the store; [] when none is."""
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            hashes, ends = self._sorted[n]
            key = _hash(np.asarray(context[-n:], dtype=np.int64))
            lo, hi = np.searchsorted(hashes, key, side="left"), np.searchsorted(hashes, key, side="right")
            if lo == hi:
                continue
            picked = ends[lo:hi]
            if len(picked) > MAX_MATCHES:
                picked = picked[np.linspace(0, len(picked) - 1, MAX_MATCHES).astype(np.int64)]
            counts = Counter(self._following(int(end)) for end in picked)
            counts.pop((), None)
            if counts:
                return [list(tokens) for tokens, _ in counts.most_common(self.branches)]
        return []

    def propose(self, context: Sequence[int], max_tokens: int, max_nodes: int | None = None) -> DraftTree:
        """The continuations as one tree, at most `max_nodes` nodes (the likeliest first)."""
        found = [c[:max_tokens] for c in self.continuations(context)]
        if not found:
            return DraftTree.chain([])
        return DraftTree.of_continuations(found, max_nodes=max_nodes or self.length * self.branches)

    def _following(self, end: int) -> tuple[int, ...]:
        """Up to `length` tokens after position `end`, stopping at a reply's end."""
        after = self.stream[end + 1 : end + 1 + self.length].tolist()
        return tuple(after[: after.index(SEPARATOR)] if SEPARATOR in after else after)


def _hash(ngram: np.ndarray) -> np.uint64:
    return _hashes(ngram[None])[0]


def _hashes(ngrams: np.ndarray) -> np.ndarray:
    """One hash per row of token ids [rows, n] (uint64; the multiplication wraps around)."""
    hashes = np.zeros(len(ngrams), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in ngrams.T.astype(np.uint64):
            hashes = hashes * _MULTIPLIER + column + np.uint64(1)
    return hashes


def _sorted_ngrams(stream: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes of every n-gram that crosses no separator, sorted; the position of each one's
    last token)."""
    ends = np.arange(n - 1, len(stream))
    ngrams = np.stack([stream[ends - offset] for offset in range(n - 1, -1, -1)], axis=1)
    clean = (ngrams != SEPARATOR).all(axis=1)
    hashes, ends = _hashes(ngrams[clean]), ends[clean]
    order = np.argsort(hashes, kind="stable")
    return hashes[order], ends[order]


def replies_stream(replies: Sequence[Sequence[int]]) -> torch.Tensor:
    """The replies laid end to end, a SEPARATOR after each (int32, as stored)."""
    stream = [token for reply in replies for token in (*reply, SEPARATOR)]
    return torch.tensor(stream, dtype=torch.int32)


def save_replies(replies: Sequence[Sequence[int]], directory: Path, source_hash: str | None) -> Path:
    """Store the model's replies in the artifact (REPLIES_FILE, hashed in the manifest, with a
    `speculator_replies` entry naming the weights they came from)."""
    from safetensors.torch import save_file

    from kiln.runtime.speculator_heads import add_file

    stream = replies_stream(replies)
    entry = {"file": REPLIES_FILE, "replies": len(replies), "tokens": len(stream) - len(replies)}
    return add_file(
        directory,
        REPLIES_FILE,
        lambda temporary: save_file({"tokens": stream}, str(temporary)),
        lambda manifest: {"speculator_replies": {**entry, "source_hash": source_hash}},
    )


def load_reply_index(directory: Path, manifest: dict) -> ReplyIndex | None:
    """The artifact's stored replies as an index; None when it has none. A damaged file, or one
    made for other weights, raises ArtifactError naming it."""
    from kiln.runtime.errors import ArtifactError
    from kiln.runtime.speculator_heads import read_listed

    entry = manifest.get("speculator_replies")
    if not entry:
        return None
    remedy = f"`kiln train-speculator {directory}`"
    if entry.get("source_hash") != manifest.get("source_hash"):
        raise ArtifactError(
            f"{Path(directory) / REPLIES_FILE} holds another model's replies (source_hash "
            f"{entry.get('source_hash')!r:.20}). Fix: make it again with {remedy}."
        )
    _, tensors = read_listed(directory, manifest, REPLIES_FILE, "stored replies file", remedy)
    return ReplyIndex(tensors["tokens"])
