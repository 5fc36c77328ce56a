"""Training draft heads: AdamW over the corpus' positions, resumable from a checkpoint file.

A sample is a position p of the corpus: the heads see h_p and t_{p+1} .. t_{p+stages} (teacher
forcing) and are scored on the model's own greedy choices after t_{p+1} .. t_{p+stages}
(g_{p+1} .. g_{p+stages}, the logits' argmax at those positions: what greedy verification
accepts; in a reply they are t_{p+2} .. t_{p+stages+1}, on text they often differ from the text),
the sum of the stages' token losses over the draft vocabulary. With `soft_targets` (the
default, as EAGLE trains) each stage's loss is the KL divergence from the model's whole distribution
there (its lm_head over the draft vocabulary applied to its real state h_{p+i}, whose argmax is
g_{p+i}): the runners-up the model nearly chose teach the heads more per position than the
greedy token alone, which matters on a corpus of a few hundred thousand tokens (held-out
accuracy and chains in docs/generation.md); without, against g_{p+i} alone (targets outside
the draft vocabulary score nothing). Heads that predict states (eagle) add their regression to
the target's states h_{p+1} .. h_{p+stages} and weight the token loss as they say. The first
`text_fraction` of the steps draw positions from text, the rest from the model's replies; a
tenth of the replies is held out for the accuracy report. The learning rate warms up over the
first 5% of steps, then decays along a cosine to a tenth.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from kiln import speculator_data as data
from kiln.runtime.last_hidden import OutputHead
from kiln.runtime.speculator_heads import DraftHeads

IGNORE = -100  # a target outside the draft vocabulary: no loss


def vocab_index(vocab_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token id -> its index in the draft vocabulary (IGNORE when outside it)."""
    index = torch.full((vocab,), IGNORE, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index


class Teacher:
    """The model's own next-token distribution over the draft vocabulary, from its real states."""

    def __init__(self, model_head: OutputHead, vocab_ids: torch.Tensor):
        self.rows = model_head.weight[vocab_ids]
        self.bias = model_head.bias[vocab_ids] if model_head.bias is not None else None

    @torch.no_grad()
    def probabilities(self, states: torch.Tensor) -> torch.Tensor:
        return F.softmax(F.linear(states, self.rows, self.bias), dim=-1)


def token_loss(logits: torch.Tensor, wanted: torch.Tensor, teacher: Teacher | None, states: torch.Tensor):
    """One stage's token loss: with a teacher (soft targets), the KL divergence from its
    distribution at the target's real `states` (the cross-entropy less the teacher's own
    entropy: the same gradient, and a loss that falls toward 0 as the heads match the model);
    else the cross-entropy against the greedy tokens `wanted`."""
    if teacher is None:
        return F.cross_entropy(logits, wanted, ignore_index=IGNORE)
    return F.kl_div(F.log_softmax(logits, dim=-1), teacher.probabilities(states), reduction="batchmean")


class Trainer:
    def __init__(self, heads: DraftHeads, corpus: data.Corpus, targets: torch.Tensor, config, model_head: OutputHead):
        self._start(heads, corpus, targets, config, model_head)
        text = corpus.positions(config.stages, replies=False)
        replies = corpus.positions(config.stages, replies=True)
        # the replies' last tenth is held out for the accuracy report
        held = max(1, len(replies) // 10) if len(replies) > 10 else 0
        self.held_out = replies[len(replies) - held :] if held else text[-max(1, len(text) // 10) :]
        replies = replies[: len(replies) - held] if held else replies
        self.pools = (text if len(text) else replies, replies if len(replies) else text)
        if not len(self.pools[0]):
            raise data.SpeculatorError(
                f"The corpus has no sequence longer than {config.stages + 1} tokens. "
                "Fix: give more text (--data FILE) or fewer --stages."
            )

    def _start(self, heads: DraftHeads, corpus: data.Corpus, targets: torch.Tensor, config, model_head: OutputHead):
        """What every trainer holds besides its sample pools: the optimizer, the sampling
        generator, the teacher of soft targets and the step count."""
        self.heads, self.corpus, self.targets, self.config = heads, corpus, targets, config
        self.teacher = Teacher(model_head, heads.vocab_ids) if config.soft_targets else None
        self.optimizer = torch.optim.AdamW(
            [p for p in heads.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.01
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step, self.last_loss = 0, float("nan")

    def _lr(self, step: int) -> float:
        warmup = max(1, self.config.steps // 20)
        if step < warmup:
            return self.config.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.config.steps - warmup)
        return self.config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def draw(self, pool: torch.Tensor) -> torch.Tensor:
        """A step's samples from `pool`: `batch` positions."""
        return pool[torch.randint(len(pool), (self.config.batch,), generator=self.generator)]

    def batch(self, positions: torch.Tensor):
        """(hidden [b, hidden], fed tokens [b, stages], targets [b, stages]) at positions p; the
        targets are draft-vocabulary indices of the model's greedy choices g_{p+1} .. g_{p+stages}."""
        window = positions[:, None] + torch.arange(1, self.config.stages + 1)
        return self.corpus.hidden[positions], self.corpus.tokens[window], self.targets[self.corpus.greedy[window]]

    def loss(self, positions: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        hidden, fed, wanted = self.batch(positions)
        next_hidden = self.corpus.hidden[positions[:, None] + torch.arange(1, self.config.stages + 1)]
        logits, extra, token_weight = self.heads.training_outputs(hidden, fed, next_hidden)
        losses = [token_loss(out, wanted[:, i], self.teacher, next_hidden[:, i]) for i, out in enumerate(logits)]
        accuracy = [
            float(((out.argmax(-1) == wanted[:, i]) & (wanted[:, i] != IGNORE)).float().mean())
            for i, out in enumerate(logits)
        ]
        total = token_weight * sum(torch.nan_to_num(loss) for loss in losses)  # nan: no target in the vocabulary
        return total + extra, accuracy

    def run(self, report, log_every: int, save, checkpoint_every: int) -> None:
        config, started, first = self.config, time.perf_counter(), self.step
        phase_change = int(config.steps * config.text_fraction)
        self.heads.train()
        try:
            while self.step < config.steps:
                pool = self.pools[0] if self.step < phase_change else self.pools[1]
                for group in self.optimizer.param_groups:
                    group["lr"] = self._lr(self.step)
                loss, accuracy = self.loss(self.draw(pool))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.heads.parameters(), 1.0)
                self.optimizer.step()
                self.step += 1
                self.last_loss = float(loss.detach())
                if self.step % log_every == 0 or self.step == config.steps:
                    rate = (time.perf_counter() - started) / (self.step - first)
                    phase = "text" if self.step <= phase_change else "replies"
                    report(
                        f"step {self.step}/{config.steps} ({phase}) loss {self.last_loss:.3f} accuracy "
                        f"{' '.join(f'{a:.2f}' for a in accuracy)} | {rate:.2f} s/step, "
                        f"ETA {data._clock(rate * (config.steps - self.step))}"
                    )
                if self.step % checkpoint_every == 0:
                    save()
        except KeyboardInterrupt:
            save()
            report(f"interrupted at step {self.step}: run the same command again to resume")
            raise
        self.heads.eval()

    @torch.no_grad()
    def evaluate(self) -> tuple[list[float], float]:
        """On the held-out positions: each stage's teacher-forced top-1 accuracy against the
        model's greedy choices, and how many tokens of the heads' own greedy chain match what the
        model would say (what greedy verification accepts per draft)."""
        positions = self.held_out[:4096]
        hidden, fed, wanted = self.batch(positions)
        accuracy = [
            float(((out.argmax(-1) == wanted[:, i]) & (wanted[:, i] != IGNORE)).float().mean())
            for i, out in enumerate(self.heads(hidden, fed))
        ]
        truth = self.corpus.greedy[positions[:, None] + torch.arange(1, self.config.stages + 1)]
        right = (self.heads.chains(hidden, fed[:, 0]) == truth).long()
        return accuracy, float(right.cumprod(dim=1).sum(dim=1).float().mean())

    def save(self, path: Path) -> None:
        state = {
            "config": dataclasses.asdict(self.config),
            "step": self.step,
            "heads": self.heads.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
        }
        temporary = path.with_name(path.name + ".tmp")
        torch.save(state, temporary)
        os.replace(temporary, path)

    def resume(self, path: Path, report) -> None:
        if not path.is_file():
            return
        try:
            state = torch.load(path, weights_only=True)
        except Exception as error:  # noqa: BLE001 - a damaged checkpoint: start over
            report(f"ignoring the unreadable checkpoint {path} ({error.__class__.__name__})")
            return
        if state.get("config") != dataclasses.asdict(self.config):
            report(f"ignoring {path}: it was made with other settings")
            return
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step = state["step"]
        report(f"resuming from step {self.step} ({path})")
