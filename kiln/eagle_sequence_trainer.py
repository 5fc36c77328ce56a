"""Training "whole" context eagle heads on whole sequences (EAGLE's way), and scoring them.

A step draws `windows` sequences of the corpus (a random stretch of at most `window` + 1 tokens
of each longer one) and runs each through the draft layer at once, causally over the target's
real states, teacher forced (eagle_heads.EagleHeads.sequence_states): every position is a draft
start, so one pass scores as many drafts as the stretch has tokens, where the "draft" form scores
one per sample. Stages after the first feed the layer's own states, attending over the real
positions before the draft's start and the draft's own after it, as drafting does. The loss is
EAGLE's (smooth L1 to the target's next state plus a tenth of the token loss against the
model's distribution there, or its greedy token without `soft_targets`), at positions a draft
may start from (a reply's prompt is context only).
Replies' last tenth is held out, as for the other heads.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kiln import speculator_data as data
from kiln.runtime.eagle_heads import REGRESSION_WEIGHT, TOKEN_WEIGHT
from kiln.speculator_trainer import IGNORE, Trainer, token_loss


class SequenceTrainer(Trainer):
    def __init__(self, heads, corpus: data.Corpus, targets: torch.Tensor, config, model_head):
        self._start(heads, corpus, targets, config, model_head)
        ends = corpus.starts[1:] + [len(corpus.tokens)]
        spans = [
            (start, end, start + first)
            for start, end, first in zip(corpus.starts, ends, corpus.learn_from)
            if end - start > heads.stages + 1
        ]
        text = [s for s, reply in zip(spans, _reply_flags(corpus, spans)) if not reply]
        replies = [s for s, reply in zip(spans, _reply_flags(corpus, spans)) if reply]
        held = max(1, len(replies) // 10) if len(replies) > 10 else 0
        self.held_out = replies[len(replies) - held :] if held else text[-max(1, len(text) // 10) :]
        replies = replies[: len(replies) - held] if held else replies
        self.pools = (text or replies, replies or text)
        if not self.pools[0]:
            raise data.SpeculatorError(
                f"The corpus has no sequence longer than {heads.stages + 1} tokens. "
                "Fix: give more text (--data FILE) or fewer --stages."
            )

    def draw(self, pool: list) -> list[tuple[int, int, int]]:
        """`windows` stretches (start, end, first draft start) of sequences from `pool`."""
        picked = torch.randint(len(pool), (self.config.windows,), generator=self.generator).tolist()
        stretches = []
        for start, end, first in (pool[i] for i in picked):
            longest = self.config.window + 1
            if end - start > longest:
                start += int(torch.randint(end - start - longest + 1, (), generator=self.generator))
                end = start + longest
            stretches.append((start, end, max(first, start)))
        return stretches

    def loss(self, stretches) -> tuple[torch.Tensor, list[float]]:
        states, starts, targets, next_hidden = self._run(stretches, noise=self.config.noise)
        regression, tokens, accuracy = 0.0, 0.0, []
        inside = torch.zeros_like(starts)  # the rows of the stretches, not their padding
        for row, (start, end, _) in enumerate(stretches):
            inside[row, : end - start - 1] = True
        for stage, state in enumerate(states):
            valid = _shifted_mask(starts, stage) & inside
            if not valid.any():
                accuracy.append(0.0)
                continue
            wanted = targets[valid]
            logits = self.heads.logits(0, state[valid])
            regression = regression + F.smooth_l1_loss(state[valid], next_hidden[valid])
            tokens = tokens + torch.nan_to_num(token_loss(logits, wanted, self.teacher, next_hidden[valid]))
            accuracy.append(float(((logits.argmax(-1) == wanted) & (wanted != IGNORE)).float().mean()))
        return REGRESSION_WEIGHT * regression + TOKEN_WEIGHT * tokens, accuracy

    def _run(self, stretches, noise: float = 0.0):
        """The heads' states per stage over padded stretches [b, n, hidden]; `starts` [b, n]:
        where a draft may start; the targets (draft-vocabulary indices of the model's greedy
        choices after each next token) and the next states."""
        corpus = self.corpus
        length = max(end - start for start, end, _ in stretches) - 1
        rows = len(stretches)
        hidden = torch.zeros(rows, length + 1, corpus.hidden.shape[1])
        tokens = torch.zeros(rows, length, dtype=torch.long)
        targets = torch.full((rows, length), IGNORE, dtype=torch.long)
        starts = torch.zeros(rows, length, dtype=torch.bool)
        for row, (start, end, first) in enumerate(stretches):
            n = end - start - 1
            hidden[row, : n + 1] = corpus.hidden[start:end]
            tokens[row, :n] = corpus.tokens[start + 1 : end]
            targets[row, :n] = self.targets[corpus.greedy[start + 1 : end]]
            starts[row, first - start : n] = True
        states = self.heads.sequence_states(hidden[:, :-1], tokens, noise)
        return states, starts, targets, hidden[:, 1:]

    @torch.no_grad()
    def evaluate(self) -> tuple[list[float], float]:
        accuracy, chain, _ = draft_scores(self.heads, self.corpus, self.held_out)
        return accuracy, chain


def draft_scores(heads, corpus, spans) -> tuple[list[float], float, int]:
    """(each stage's top-1 accuracy against the model's greedy choices, the tokens of the draft's
    own greedy chain that match them per draft, the drafts counted) over every draft start p of
    `spans` ((start, end, first) of `corpus`'s token stream: p >= first with all stages inside),
    each draft attending over its sequence's real states before it. `corpus` has tokens,
    hidden and greedy (speculator_data.Corpus or alike)."""
    stages, right, count = heads.stages, [], 0
    for start, end, first in spans:
        drafts = end - stages - 1 - first  # starts p in [first, end - stages - 1)
        if drafts <= 0:
            continue
        states = heads.sequence_states(corpus.hidden[start : end - 1][None], corpus.tokens[start + 1 : end][None])
        greedy = corpus.greedy[start + 1 : end]
        offset = first - start
        hits = []
        for stage, state in enumerate(states):
            picks = heads.vocab_ids[heads.logits(0, state[0, offset + stage : offset + stage + drafts]).argmax(-1)]
            hits.append(picks == greedy[offset + stage : offset + stage + drafts])
        right.append(torch.stack(hits, dim=1))
        count += drafts
    if not right:
        return [0.0] * stages, 0.0, 0
    right = torch.cat(right).long()
    accuracy = [float(right[:, stage].float().mean()) for stage in range(stages)]
    return accuracy, float(right.cumprod(dim=1).sum(dim=1).float().mean()), count


def _reply_flags(corpus, spans) -> list[bool]:
    reply_of = dict(zip(corpus.starts, corpus.replies))
    return [reply_of[start] for start, _, _ in spans]


def _shifted_mask(starts: torch.Tensor, stage: int) -> torch.Tensor:
    """Rows t whose draft start t - stage may start a draft."""
    if stage == 0:
        return starts
    return torch.cat((torch.zeros_like(starts[:, :stage]), starts[:, :-stage]), dim=1)
