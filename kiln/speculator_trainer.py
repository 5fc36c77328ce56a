"""Training draft heads: AdamW over the corpus' positions, resumable from a checkpoint file.

A sample is a position p of the corpus: the heads see h_p and t_{p+1} .. t_{p+stages} (teacher
forcing) and are scored on the model's own greedy choices after t_{p+1} .. t_{p+stages}
(g_{p+1} .. g_{p+stages}, the logits' argmax at those positions: what greedy verification
accepts; in a reply they are t_{p+2} .. t_{p+stages+1}, on text they often differ from the text),
the sum of the stages' cross-entropies over the draft vocabulary (targets outside it score
nothing); heads that predict states (eagle) add their regression to the target's states
h_{p+1} .. h_{p+stages} and weight the cross-entropy as they say. The first `text_fraction` of the steps
draw positions from text, the rest from the model's replies; a tenth of the replies is held out
for the accuracy report. The learning rate warms up over the first 5% of steps, then decays
along a cosine to a tenth.
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
from kiln.runtime.speculator_heads import DraftHeads

IGNORE = -100  # a target outside the draft vocabulary: no loss


def vocab_index(vocab_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token id -> its index in the draft vocabulary (IGNORE when outside it)."""
    index = torch.full((vocab,), IGNORE, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    return index


class Trainer:
    def __init__(self, heads: DraftHeads, corpus: data.Corpus, targets: torch.Tensor, config):
        self.heads, self.corpus, self.targets, self.config = heads, corpus, targets, config
        self.optimizer = torch.optim.AdamW(
            [p for p in heads.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.01
        )
        self.generator = torch.Generator().manual_seed(config.seed)
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
        losses = [F.cross_entropy(out, wanted[:, i], ignore_index=IGNORE) for i, out in enumerate(logits)]
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
