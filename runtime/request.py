"""One request as the runtime sees it: `GenerationSettings` (what is asked) and `Request` (where
it is, what it has generated, and how it samples). The caller holds a `RequestHandle`
(request_handle.py) to read it from another thread; everything else about a request is here.

A `Request` goes WAITING -> RUNNING (it holds a KV-cache row, `kv_row`) -> DONE, CANCELLED or
FAILED (`status`). While running, `fed` counts the prompt and generated tokens whose keys and
values sit in its row; `unfed` more wait to be fed (a prompt chunk when more than one, else
a decode step). Whoever runs the model (the engine, or a speculative generation) calls
`accept(logits)` with the logits after the newest token: the request samples (or takes the token
a constraint forces), appends it, and sets `finish_reason` when its generation ends.

A request with a constraint (json_schema / regex / choices, constraints.py) samples only tokens
its grammar allows and takes forced tokens without sampling. Fast-forward appends the forced
tokens ahead (`push_forced`); the engine then feeds them with the newest token in one
multi-token call.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.runtime.constraints import CompiledConstraint
from kiln.runtime.detokenizer import IncrementalDecoder
from kiln.runtime.draft_tree import DraftTree
from kiln.runtime.results import GenerationResult, GenerationStats
from kiln.runtime.sampler import Sampler, SamplingParams, TokenLogprob
from kiln.runtime.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class GenerationSettings:
    """What every prompt of a `generate` call (or one `submit`) is asked for."""

    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()  # end like EOS, with finish_reason "stop"
    constraint: CompiledConstraint | None = None  # json_schema / regex / choices (constraint_compiler.py)
    # speculative decoding inside the engine: each request's own drafter (e.g. PromptLookupDrafter)
    drafter_factory: Callable[[], object] | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a KV row
    RUNNING = "running"  # holds `kv_row`: prefilling or decoding
    DONE = "done"  # generation ended (finish_reason says why); the row is free again
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (RequestStatus.DONE, RequestStatus.CANCELLED, RequestStatus.FAILED)


def max_new_tokens_that_fit(prompt_len: int, requested: int, max_seq_len: int) -> int:
    """Every token fed to the model needs a cache slot; the last new token is never fed, so a
    prompt of length L can get up to max_seq_len - L + 1 new tokens."""
    return max(0, min(requested, max_seq_len - prompt_len + 1))


class Request:
    """One prompt from submission to its result (see the module docstring).

    `model_steps` counts the model calls whose logits it used (`accept`, `verify`), `forced_count`
    the tokens a constraint forced."""

    def __init__(
        self,
        prompt: list[int],
        settings: GenerationSettings,
        seed: int,
        max_seq_len: int,
        decoder: IncrementalDecoder | None = None,
        handle=None,
    ):
        self.prompt = prompt
        self.settings = settings
        self.handle = handle  # the caller's RequestHandle (None outside the engine)
        self.status = RequestStatus.WAITING
        self.kv_row: int | None = None
        self.fed = 0
        self.reused = 0  # prompt tokens whose keys and values a cached prefix supplied
        self.max_new = max_new_tokens_that_fit(len(prompt), settings.max_new_tokens, max_seq_len)
        self.clamped = self.max_new < settings.max_new_tokens
        self.logprobs = [] if settings.sampling.logprobs is not None else None
        self.seed = seed
        self.sampler = Sampler(settings.sampling, seed, settings.eos_ids | settings.stop_token_ids)
        self.decoder = decoder
        self.stop = StopStringMatcher(settings.stop)
        self.constraint = settings.constraint.start() if settings.constraint is not None else None
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None if self.max_new > 0 else ("context" if self.clamped else "length")
        self.model_steps = 0
        self.forced_count = 0
        self.drafter = settings.drafter_factory() if settings.drafter_factory is not None else None
        self.target_steps = self.drafted_tokens = self.accepted_tokens = 0  # speculative steps only
        self.preemptions = 0  # times a paged cache's engine took its blocks back (engine_paging.py)
        self.submitted_at = time.perf_counter()
        self.ttft_s = self.prefill_s = self.decode_s = 0.0

    @property
    def id(self) -> int | None:
        return self.handle.id if self.handle is not None else None

    @property
    def generating(self) -> bool:
        """Whether more tokens are to come (no finish_reason yet)."""
        return self.finish_reason is None

    # -- what to feed ----------------------------------------------------------------------
    @property
    def unfed(self) -> int:
        """How many tokens wait to be fed (no list built: the scheduler asks every step)."""
        return len(self.prompt) + len(self.tokens) - self.fed

    def newest(self) -> int:
        """The next token to feed (the only one, in a decode step)."""
        prompt, fed = self.prompt, self.fed
        return prompt[fed] if fed < len(prompt) else self.tokens[fed - len(prompt)]

    def pending(self) -> list[int]:
        """The tokens to feed before the next sampling: the prompt's rest, then generated tokens."""
        prompt, fed = self.prompt, self.fed
        if fed < len(prompt):
            return prompt[fed:] + self.tokens
        return self.tokens[fed - len(prompt) :]

    # -- sampling ----------------------------------------------------------------------------
    def accept(self, logits: torch.Tensor) -> str:
        """Sample the next token from logits [vocab] (among the tokens a constraint allows, or
        the one it forces); return the text it completes."""
        self.model_steps += 1
        if self.drafter is not None and self.tokens:  # a decode step that had no drafts to verify
            self.target_steps += 1
        if self.drafter is not None:
            self._observe(logits[None], [0], len(self.prompt) + len(self.tokens) - 1)
        return self._sample(logits)

    @property
    def reads_prompt(self) -> bool:
        """Whether the drafter keeps every position's state (the prompt's and each accepted token's:
        observe_rows), not the newest one alone (observe)."""
        return bool(getattr(self.drafter, "reads_prompt", False))

    def observe_prompt(self, logits: torch.Tensor, first: int) -> None:
        """Prompt positions' logits rows [k, vocab] from `first` on, for a drafter that reads_prompt."""
        if self.reads_prompt and len(logits):
            self.drafter.observe_rows(logits, first)

    def _observe(self, logits: torch.Tensor, rows: list[int], first: int) -> None:
        """Show a drafter that reads them (draft heads) the raw logits `rows` of `logits`, at
        positions first .. first + len(rows) - 1, the last of which chose the newest token: every
        row to a drafter that reads_prompt, the last alone to others (no gather on their steps)."""
        if self.reads_prompt:
            self.drafter.observe_rows(logits[rows], first)
            return
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:
            observe(logits[rows[-1]])

    def _sample(self, logits: torch.Tensor) -> str:
        if self.constraint is None:
            return self.push(self.sampler.choose(logits, self.prompt, self.tokens))
        forced = self.constraint.forced(1)
        if forced:
            return self.push(self.sampler.score(logits, forced[0]))
        allowed = self.constraint.allowed(logits.shape[-1])
        return self.push(self.sampler.choose(logits, self.prompt, self.tokens, allowed=allowed))

    def forced_tokens(self) -> list[int]:
        """The tokens the constraint forces next, within the token budget: what `push_forced`
        would append. Empty without a constraint, when fast-forward is off, or when
        log-probabilities were asked for (forced tokens then come one decode step each, scored)."""
        if self.constraint is None or not self.constraint.fast_forward or self.logprobs is not None:
            return []
        if not self.generating:
            return []
        return self.constraint.forced(self.max_new - len(self.tokens))

    def push_forced(self) -> str:
        """Append `forced_tokens()` without sampling; return the text they complete. The caller
        feeds them (they have no keys and values yet)."""
        return "".join(self.push(TokenLogprob(token, 0.0)) for token in self.forced_tokens() if self.generating)

    def push(self, choice: TokenLogprob) -> str:
        """Append a chosen token; return the text it completes."""
        token = choice.token
        if self.constraint is not None and self.constraint.advance(token):
            self.forced_count += 1
        self.tokens.append(token)
        if self.logprobs is not None:
            self.logprobs.append(choice)
        piece = ""
        if token in self.settings.eos_ids:
            self.finish_reason = "eos"
        elif token in self.settings.stop_token_ids:
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
        if not self.generating:
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

    # -- speculative steps ------------------------------------------------------------------------
    def draft(self, max_seq_len: int, trees: bool = False, vocab_size: int | None = None) -> DraftTree:
        """The drafter's guesses for the tokens after the newest one (a tree where the caller
        verifies `trees`, else its first path), within what the token budget and the cache leave
        (the target adds a token of its own after them), without ids the model lacks.
        Empty while prompt tokens are fed: the first new token always comes from the prompt alone,
        so a seeded sample does not depend on how the prompt was chunked or cached."""
        if self.drafter is None or self.constraint is not None or not self.generating or self.fed < len(self.prompt):
            return DraftTree.chain([])
        room = min(max_seq_len - 1 - self.fed, self.max_new - len(self.tokens) - 1)
        if room <= 0:
            return DraftTree.chain([])
        proposal = self.drafter.propose(self.prompt + self.tokens, room)
        if not isinstance(proposal, DraftTree):
            proposal = DraftTree.chain(proposal)
        elif not trees:
            proposal = DraftTree.chain(proposal.first_path())
        tree = proposal.within(vocab_size, max_nodes=len(proposal))
        # every path within the budget: a tree deeper than `room` keeps its nodes up to that depth
        if max(tree.depths(), default=0) > room:
            keep = [i for i, depth in enumerate(tree.depths()) if depth <= room]
            tree = DraftTree(tuple(tree.tokens[i] for i in keep), tuple(tree.parents[i] for i in keep))
        return tree

    def verify(self, logits: torch.Tensor, draft: list[int]) -> tuple[str, int]:
        """`verify_tree` of a chain: returns the text emitted and how many drafts were accepted."""
        piece, path = self.verify_tree(logits, DraftTree.chain(draft))
        return piece, len(path)

    def verify_tree(self, logits: torch.Tensor, tree: DraftTree) -> tuple[str, list[int]]:
        """Judge the drafts with the target's logits [1 + len(tree), vocab] after the newest token
        and after each node: from the newest token down, the target picks among the node's
        children (`judge`); each accepted child is emitted and the walk goes on from it; the first
        choice that is no child is emitted and ends the step (a leaf's next token is free). Returns
        the text emitted and the accepted nodes, root first (their keys and values are valid)."""
        self.target_steps += 1
        self.model_steps += 1
        newest = len(self.prompt) + len(self.tokens) - 1  # the fed newest token's position
        pieces, path, at = [], [], -1
        while True:
            children = tree.children(at)
            if not children:
                if self.generating:  # the target's token after the last accepted draft is free
                    pieces.append(self._sample(logits[at + 1]))
                break
            choice = self.judge(logits[at + 1], [tree.tokens[c] for c in children])
            pieces.append(self.push(choice))
            hit = next((c for c in children if tree.tokens[c] == choice.token), None)
            if hit is None or not self.generating:
                break
            path.append(hit)
            at = hit
        # the rows at the newest token and the accepted nodes: the last one chose the newest token
        self._observe(logits, [0, *(node + 1 for node in path)], newest)
        self.drafted_tokens += len(tree)
        self.accepted_tokens += len(path)
        self.drafter.feedback(max(tree.depths(), default=0), len(path))
        return "".join(pieces), path

    def judge(self, logits: torch.Tensor, guesses: list[int]) -> TokenLogprob:
        """The token to emit where the drafter guessed one of `guesses` (distinct): greedy, the
        target's argmax; sampled, each guess in turn with its probability under what the earlier
        rejected guesses leave of p, else a draw from that rest (drafts are deterministic, so this
        is the accept/reject rule of speculative sampling over several candidates: every emitted
        token is distributed as the target's processed distribution)."""
        sampler = self.sampler
        raw = logits.detach().float().cpu()
        processed = sampler.process(raw, self.prompt, self.tokens)
        if self.settings.sampling.greedy:
            token = int(processed.numpy().argmax())
        else:
            rest = torch.softmax(processed, dim=-1)
            token = None
            for guess in guesses:
                if float(torch.rand((), generator=sampler.generator)) * float(rest.sum()) < float(rest[guess]):
                    token = guess
                    break
                rest = rest.clone()
                rest[guess] = 0.0
            if token is None:
                token = int(torch.multinomial(rest / rest.sum(), 1, generator=sampler.generator))
        return sampler._with_logprobs(raw, token)

    # -- the end -------------------------------------------------------------------------------
    def result(self, **stats_of_the_caller) -> GenerationResult:
        """The result so far; `stats_of_the_caller` sets GenerationStats fields that whoever
        ran the model knows (a speculative generation's target steps)."""
        stats = dict(
            tokens_in=len(self.prompt),
            tokens_out=len(self.tokens),
            ttft_s=self.ttft_s,
            prefill_s=self.prefill_s,
            decode_s=self.decode_s,
            max_new_tokens=self.max_new,
            clamped=self.clamped,
            cached_tokens=self.reused,
            model_steps=self.model_steps,
            forced_tokens=self.forced_count,
        )
        if self.target_steps:
            stats.update(
                target_steps=self.target_steps,
                drafted_tokens=self.drafted_tokens,
                accepted_tokens=self.accepted_tokens,
                tokens_per_target_step=(len(self.tokens) - 1) / self.target_steps,
            )
        stats.update(stats_of_the_caller)
        return GenerationResult(
            text=self.text,
            token_ids=list(self.tokens),
            finish_reason=self.finish_reason or "length",
            prompt_token_ids=list(self.prompt),
            logprobs=self.logprobs,
            stats=GenerationStats(**stats),
        )
