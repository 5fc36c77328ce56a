"""Beam search over KV rows: Hugging Face's `generate(num_beams=k, do_sample=False)`, token for token.

    llm.generate(prompt, num_beams=4, length_penalty=1.0, early_stopping=False)   # the best beam
    llm.generate(prompt, num_beams=4, num_return_sequences=2)                     # the 2 best

Each beam lives in a KV row of its own (rows 0 .. k-1, held alone while the search runs). The
prompt is prefilled once, into row 0. Every step then
1. scores each beam's continuations: the log-softmax of its logits (min_tokens / bad_words bans
   applied to the log-probabilities, as Hugging Face applies its processors) plus the beam's
   running sum;
2. keeps the best K = max(2, 1 + number of end tokens) * k of all k x vocab candidates: the
   first k of them that end (an end token, or the length limit) are offered to the finished
   hypotheses with score sum / new_tokens ** length_penalty; the best k that do not end run on;
3. forks rows: a beam continuing a row keeps it, a second child of the same beam copies the
   parent's cached prefix into a row no beam continues (`copy_prefix`; never recomputed);
4. runs one decode call over the k rows with each beam's new token.
It stops as Hugging Face does: `early_stopping=True` once k hypotheses have finished; False
once the best running beam, at its current length, cannot beat the worst finished one;
"never" likewise but at the longest length a positive length_penalty could reach. The
arithmetic mirrors transformers' `_beam_search` (the same float32 tensors, -1e9 masks and
top-k calls), so equal logits give equal beams.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kiln.backends.cache_rows import copy_prefix
from kiln.runtime.request import GenerationSettings, Request
from kiln.runtime.results import GenerationResult
from kiln.runtime.row_prefill import prefill_row0
from kiln.runtime.sampler import TokenLogprob
from kiln.runtime.token_ids import check_request_ids, model_vocab_size

NEG = -1.0e9  # Hugging Face's mask value: a score that can no longer be picked


@dataclass(frozen=True)
class BeamOptions:
    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    num_return_sequences: int = 1


@dataclass
class Hypotheses:
    """k sequences with their scores (beam order), as Hugging Face's per-batch tensors."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob]]
    scores: torch.Tensor  # float32 [k]

    def gather(self, index: torch.Tensor) -> Hypotheses:
        picked = index.tolist()
        return Hypotheses([self.tokens[i] for i in picked], [self.logprobs[i] for i in picked], self.scores[index])


class BeamSearch:
    """One prompt's beam search. Iterate for one (0, text of the best beam) pair once it ends,
    then read `results()`; the interface of EngineBatch, for one prompt."""

    prompt_count = 1

    def __init__(
        self,
        executable,
        prompt: list[int],
        settings: GenerationSettings,
        seed: int,
        options: BeamOptions,
        decoder_factory=None,
        vocab_size: int | None = None,
    ):
        check_request_ids(prompt, settings, vocab_size or model_vocab_size(executable))
        self.executable, self.prompt, self.settings, self.seed = executable, list(prompt), settings, seed
        self.options, self.decoder_factory = options, decoder_factory
        self.max_seq_len = executable.options.max_seq_len
        self.end_ids = settings.eos_ids | settings.stop_token_ids
        self.want_logprobs = settings.sampling.logprobs
        # Only for its bans and its record of the length limit: beams share no sampling state
        self.request = Request(self.prompt, settings, seed, self.max_seq_len)
        self.model_steps = 0
        self.prefill_s = self.decode_s = 0.0
        self._results: list[GenerationResult] = []

    def __iter__(self):
        start = time.perf_counter()
        finished = self._search() if self.request.generating else None
        elapsed = time.perf_counter() - start
        self._results = [
            self._result(tokens, logprobs, elapsed)
            for tokens, logprobs in (zip(finished.tokens, finished.logprobs) if finished else [([], [])])
        ]
        self._results = self._results[: self.options.num_return_sequences]
        if self._results[0].text:
            yield 0, self._results[0].text

    def results(self) -> list:
        """[the best beam's GenerationResult], or [the num_return_sequences best] when asked for more."""
        return [self._results] if self.options.num_return_sequences > 1 else self._results[:1]

    # -- the search --------------------------------------------------------------------
    def _search(self) -> Hypotheses:
        k, opts = self.options.num_beams, self.options
        keep = max(2, 1 + len(self.end_ids)) * k
        first_k = torch.zeros(keep, dtype=torch.bool)
        first_k[:k] = True
        max_new = self.request.max_new
        running = Hypotheses([[] for _ in range(k)], [[] for _ in range(k)], torch.zeros(k))
        running.scores[1:] = NEG  # every beam starts as the prompt: only beam 0's continuations count
        finished = Hypotheses([[] for _ in range(k)], [[] for _ in range(k)], torch.full((k,), NEG))
        is_finished = torch.zeros(k, dtype=torch.bool)
        improvable = True
        rows = [0] * k
        logits = self._prefill().expand(k, -1)
        generated = 0
        while True:
            raw = torch.log_softmax(logits.float(), dim=-1)
            log_probs = self._banned(raw, running.tokens)
            vocab = log_probs.shape[-1]
            top_scores, top_index = torch.topk((log_probs + running.scores[:, None]).reshape(-1), k=keep)
            parents, tokens = (top_index // vocab).tolist(), (top_index % vocab).tolist()
            ends = torch.tensor([t in self.end_ids or generated + 1 >= max_new for t in tokens])
            candidates = Hypotheses(
                [running.tokens[p] + [t] for p, t in zip(parents, tokens)],
                [running.logprobs[p] + [self._logprob(raw[p], t)] for p, t in zip(parents, tokens)],
                top_scores,
            )
            # the best k that do not end run on
            on_scores = top_scores + ends.to(torch.float32) * NEG
            chosen = torch.topk(on_scores, k=k)[1]
            next_running = candidates.gather(chosen)
            next_running.scores = on_scores[chosen]
            finished, is_finished = self._finish(
                finished, is_finished, candidates, ends & first_k, generated + 1, improvable
            )
            parent_rows = [rows[parents[i]] for i in chosen.tolist()]
            running = next_running
            generated += 1
            improvable = improvable and self._improvable(running.scores, finished.scores, is_finished, generated)
            if (
                not improvable
                or (bool(torch.all(is_finished)) and opts.early_stopping is True)
                or bool(torch.all(ends))
            ):
                return finished
            rows = self._fork(parent_rows, len(self.prompt) + generated - 1)
            logits = self._decode(rows, [beam[-1] for beam in running.tokens], len(self.prompt) + generated - 1)

    def _finish(
        self,
        finished: Hypotheses,
        is_finished: torch.Tensor,
        candidates: Hypotheses,
        just_ended: torch.Tensor,
        length: int,
        improvable: bool,
    ) -> tuple[Hypotheses, torch.Tensor]:
        """The k best of the finished hypotheses and the candidates that just ended among the
        first k, scored sum / length ** length_penalty; none join once k have finished with
        early_stopping=True, or once no improvement is possible."""
        opts = self.options
        offered = candidates.scores / (length**opts.length_penalty)
        offered = offered + (torch.all(is_finished) & (opts.early_stopping is True)).to(torch.float32) * NEG
        offered = offered + torch.tensor(not improvable).to(torch.float32) * NEG
        offered = offered + (~just_ended) * NEG
        merged = Hypotheses(
            finished.tokens + candidates.tokens,
            finished.logprobs + candidates.logprobs,
            torch.cat((finished.scores, offered)),
        )
        best = torch.topk(merged.scores, k=opts.num_beams)[1]
        return merged.gather(best), torch.cat((is_finished, just_ended))[best]

    def _improvable(self, running_scores, finished_scores, is_finished, generated: int) -> bool:
        """Hugging Face's early-stop heuristic: can the best running beam still beat the worst
        finished hypothesis (at `generated` new tokens, or at the limit with early_stopping
        "never" and a positive length penalty)?"""
        opts = self.options
        length = generated
        if opts.early_stopping == "never" and opts.length_penalty > 0.0:
            length = self.request.max_new
        best_possible = running_scores[:1] / (length**opts.length_penalty)
        worst = torch.where(is_finished, torch.min(finished_scores), NEG)
        return bool(torch.any(best_possible > worst))

    def _banned(self, log_probs: torch.Tensor, beams: list[list[int]]) -> torch.Tensor:
        """Each beam's log-probabilities with min_tokens / bad_words bans at -inf (after the
        log-softmax, as Hugging Face's processors run in beam search)."""
        sampler = self.request.sampler
        if not sampler._bans_tokens:
            return log_probs
        return torch.stack([sampler.ban(row, self.prompt, beam) for row, beam in zip(log_probs, beams)])

    def _logprob(self, raw: torch.Tensor, token: int) -> TokenLogprob:
        """The token's log-probability under the model (and the top alternatives), when asked for."""
        if self.want_logprobs is None:
            return TokenLogprob(token, 0.0)
        top = torch.topk(raw, min(self.want_logprobs, raw.numel())) if self.want_logprobs else None
        alternatives = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        return TokenLogprob(token, float(raw[token]), alternatives)

    # -- the model and the rows ----------------------------------------------------------
    def _prefill(self) -> torch.Tensor:
        """The prompt into row 0; the logits [vocab] after it."""
        start = time.perf_counter()
        logits = prefill_row0(self.executable, self.prompt)
        self.model_steps += 1
        self.prefill_s = time.perf_counter() - start
        return logits

    def _fork(self, parent_rows: list[int], length: int) -> list[int]:
        """Rows for the new beams, whose parents sit in `parent_rows` with `length` slots cached:
        the first child of a row keeps it; another child copies the prefix into a row that no
        new beam continues (copies only read kept rows, so their order does not matter)."""
        rows: list[int | None] = [None] * len(parent_rows)
        kept: set[int] = set()
        for beam, row in enumerate(parent_rows):
            if row not in kept:
                kept.add(row)
                rows[beam] = row
        free = [row for row in range(len(parent_rows)) if row not in kept]
        views = None
        for beam, row in enumerate(parent_rows):
            if rows[beam] is None:
                views = views if views is not None else self.executable.cache_views()
                rows[beam] = free.pop(0)
                copy_prefix(views, row, rows[beam], length)
        return rows

    def _decode(self, rows: list[int], tokens: list[int], position: int) -> torch.Tensor:
        """One call over rows [0, k): each beam's newest token at `position`; logits [k, vocab] in beam order."""
        start = time.perf_counter()
        by_row = [0] * len(rows)
        for row, token in zip(rows, tokens):
            by_row[row] = token
        out = self.executable.run(torch.tensor(by_row)[:, None], torch.full((len(rows), 1), position))
        self.model_steps += 1
        self.decode_s += time.perf_counter() - start
        return out[:, 0].float().cpu()[torch.tensor(rows)]

    # -- the end -----------------------------------------------------------------------------
    def _result(self, tokens: list[int], logprobs: list[TokenLogprob], elapsed: float) -> GenerationResult:
        """A hypothesis as a GenerationResult: its tokens replayed through a Request (text,
        finish_reason), with the search's timings."""
        request = Request(
            self.prompt,
            self.settings,
            self.seed,
            self.max_seq_len,
            self.decoder_factory() if self.decoder_factory else None,
        )
        for _token, logprob in zip(tokens, logprobs):
            request.push(logprob)
        request.prefill_s, request.decode_s = self.prefill_s, elapsed - self.prefill_s
        request.ttft_s = elapsed  # no token is final before the search ends
        return request.result(model_steps=self.model_steps)
