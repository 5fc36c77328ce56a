"""Speculative decoding for one prompt: k drafted tokens checked in one target-model step.

A drafter proposes tokens; the target runs `[last, d1 .. dk]` at positions `p .. p+k` in one
call (the same compiled graph as prefill) and its logits at each position judge the next draft:
- greedy: a draft is accepted while it equals the target's own choice, so the output is the
  target's greedy output exactly;
- sampled: drafts are deterministic (q is one-hot), so the standard accept/reject rule reduces
  to: accept d with probability p(d); on rejection draw from p with d removed. Every emitted
  token is then distributed as the target's (processed) distribution.
Either way the target adds one token of its own after the last accepted draft, so each step
emits between 1 and k+1 tokens. Slots written for rejected drafts hold junk that the next
step overwrites before any query can see it (a query at position q reads only slots <= q).

Drafters:
- `PromptLookupDrafter`: the longest recent n-gram's earlier occurrence in the context, and
  what followed it (no model needed; strong on edits, code and quoting); its draft length adapts
  to the acceptance history (grow after a fully accepted draft, shrink to what was accepted);
- `ModelDrafter`: a smaller or quantized model compiled by the same pipeline (same tokenizer),
  drafting greedily and stopping when the draft's cumulative probability falls below a
  threshold (threshold-adaptive draft length);
- `HeadsDrafter` (heads_drafter.py): trained heads on the target's last hidden state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kiln.backends.executable import capabilities
from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.engine import PREFILL_CHUNK
from kiln.runtime.request import GenerationSettings, Request
from kiln.runtime.results import GenerationResult
from kiln.runtime.token_ids import check_request_ids, known_prefix, model_vocab_size


class Drafter(Protocol):
    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens guesses for what follows `context`."""

    def feedback(self, drafted: int, accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted."""

    # Optional: `observe(logits)` is called with the raw logits [vocab] that chose each step's
    # newest token (prefill's last, then the last one a verification step emitted): what draft
    # heads on the target's last hidden state read (heads_drafter.py). A drafter whose
    # `reads_prompt` is true gets `observe_rows(logits, first)` instead: the rows [k, vocab] at
    # positions first .. first + k - 1 of the prompt and of every accepted token.


class PromptLookupDrafter:
    """Drafts by n-gram lookup in the context itself: what followed the longest recent n-gram's
    most recent earlier occurrence, and, with `branches` > 1, what followed its other recent
    occurrences too, as one token tree (a caller that verifies chains takes its first path)."""

    def __init__(
        self, max_ngram: int = 3, max_draft: int = 8, min_draft: int = 1, min_ngram: int = 1, branches: int = 3
    ):
        self.max_ngram, self.max_draft, self.min_draft, self.min_ngram = max_ngram, max_draft, min_draft, min_ngram
        self.branches = branches
        self.length = max_draft

    def propose(self, context: Sequence[int], max_tokens: int) -> DraftTree:
        limit = min(self.length, max_tokens)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = list(context[-n:])
            continuations = []
            for start in range(len(context) - n - 1, -1, -1):  # the most recent earlier matches first
                if list(context[start : start + n]) == tail:
                    continuations.append(list(context[start + n : start + n + limit]))
                    if len(continuations) == self.branches:
                        break
            if continuations:
                return DraftTree.of_continuations(continuations, max_nodes=limit + (self.branches - 1) * limit // 2)
        return DraftTree.chain([])

    def feedback(self, drafted: int, accepted: int) -> None:
        if drafted and accepted == drafted:
            self.length = min(self.max_draft, self.length + 2)
        elif drafted:
            self.length = max(self.min_draft, accepted + 1)


class ModelDrafter:
    """Greedy drafts from another compiled model sharing the tokenizer; stops drafting when the
    product of the draft model's probabilities for its own tokens drops below `threshold`."""

    def __init__(self, executable, max_draft: int = 8, threshold: float = 0.3, vocab_size: int | None = None):
        self.executable, self.max_draft, self.threshold = executable, max_draft, threshold
        self.cached: list[int] = []  # the context tokens whose keys/values the draft model holds
        self.max_seq_len = executable.options.max_seq_len
        self.vocab_size = vocab_size or model_vocab_size(executable)

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        keep = _common_prefix(self.cached, context, limit=len(context) - 1)  # rejected drafts drop out
        self.cached = list(context[:keep])
        feed = list(context[keep:])
        if known_prefix(feed, self.vocab_size) < len(feed):
            return []  # a token beyond the draft model's vocabulary (a larger target's): it cannot read on
        draft, confidence = [], 1.0
        while len(draft) < min(self.max_draft, max_tokens) and len(self.cached) + len(feed) <= self.max_seq_len:
            positions = torch.arange(len(self.cached), len(self.cached) + len(feed))[None]
            probs = torch.softmax(self.executable.run(torch.tensor([feed]), positions)[0, -1].float(), dim=-1)
            self.cached += feed
            token = int(torch.argmax(probs))
            confidence *= float(probs[token])
            if confidence < self.threshold:
                break
            draft.append(token)
            feed = [token]
        return draft

    def feedback(self, drafted: int, accepted: int) -> None:
        pass  # the cache check in propose() handles what was rejected


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < min(len(a), len(b), limit) and a[n] == b[n]:
        n += 1
    return n


class SpeculativeGeneration:
    """One prompt generated with a drafter. Iterate for (0, text piece) pairs, then read
    `results()`; the same interface as EngineBatch, for a batch of one."""

    prompt_count = 1

    def __init__(
        self,
        executable,
        prompt: list[int],
        settings: GenerationSettings,
        seed: int,
        drafter: Drafter,
        decoder_factory=None,
        vocab_size: int | None = None,
    ):
        self.executable = executable
        self.vocab_size = vocab_size or model_vocab_size(executable)
        check_request_ids(prompt, settings, self.vocab_size)
        self.max_seq_len = executable.options.max_seq_len
        self.exact_width = capabilities(executable).exact_width
        self.request = Request(
            list(prompt), settings, seed, self.max_seq_len, decoder_factory() if decoder_factory else None
        )
        self.request.drafter = self.drafter = drafter  # the request judges the drafts and gives feedback

    def __iter__(self):
        request = self.request
        if not request.generating:
            return
        start = time.perf_counter()
        logits = self._prefill(request.prompt)
        request.prefill_s = request.ttft_s = time.perf_counter() - start
        request.observe_prompt(logits[:-1], 0)
        piece = request.accept(logits[-1])  # which shows a drafter that reads them the logits
        if piece:
            yield 0, piece
        while request.generating:
            start = time.perf_counter()
            pieces = self._step()
            request.decode_s += time.perf_counter() - start
            yield from ((0, p) for p in pieces if p)

    def _prefill(self, prompt: list[int]) -> torch.Tensor:
        """The prompt's logits [len, vocab], fed in the engine's chunks: the keys and values a
        call writes can differ by rounding with the call's width, so the same chunks keep the
        greedy output the engine's."""
        if len(prompt) <= PREFILL_CHUNK:
            return self.executable.run(torch.tensor([prompt]), torch.arange(len(prompt))[None])[0]
        rows = []
        for first in range(0, len(prompt), PREFILL_CHUNK):
            chunk = prompt[first : first + PREFILL_CHUNK]
            positions = torch.arange(first, first + len(chunk))[None]
            rows.append(self.executable.run(torch.tensor([chunk]), positions)[0].clone())
        return torch.cat(rows)

    def _step(self) -> list[str]:
        """Draft, verify in one target call, emit the accepted tokens and the target's own."""
        request = self.request
        context = request.prompt + request.tokens
        position = len(context) - 1  # the newest token's slot
        room = min(self.max_seq_len - 1 - position, request.max_new - len(request.tokens) - 1)
        room = min(room, self.exact_width - 1) if self.exact_width else room  # greedy output stays plain's
        draft = self.drafter.propose(context, room) if room > 0 else []
        if isinstance(draft, DraftTree):  # one call verifies one chain here
            draft = draft.first_path()
        # a drafter's guesses as the target can take them: within the room left, ids it knows
        draft = list(draft[: known_prefix(draft[:room], self.vocab_size)])
        feed = [context[-1], *draft]
        positions = torch.arange(position, position + len(feed))[None]
        logits = self.executable.run(torch.tensor([feed]), positions)[0]
        piece, _ = request.verify(logits, draft)  # the request shows the drafter the row that chose its newest token
        return [piece]

    def results(self) -> list[GenerationResult]:
        return [self.request.result()]
