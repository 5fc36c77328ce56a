"""What draft heads train on: the target's last hidden states over text and over its own replies.

Two sources, as in IBM's two training phases:
- text: the bundled Moby-Dick calibration chapters (kiln/data) and any `--data` files, cut into
  chunks of at most the artifact's max_seq_len;
- replies: the model's own greedy answers to the bundled chat prompts
  (kiln/data/speculator_prompts.txt), so the heads learn what the model itself says.
Each sequence is run through the compiled executable once, like a prefill; the hidden state at
every position is solved from its logits (kiln.runtime.last_hidden), exactly as the drafter does
at generation time, and the logits' argmax kept: the model's own greedy choice of the next token,
which is what the heads learn to predict (on text as on replies: a draft is accepted when it is
the model's choice, not the text's). The replies are generated as one list of prompts, which the
engine decodes side by side up to the artifact's max_batch. The result is cached beside the
artifact, keyed by its weights and the sources, so training other kinds or resuming skips the
collection.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.moby_dick import CALIBRATION_FILE
from kiln.runtime.last_hidden import HiddenFromLogits, OutputHead, SpeculatorError

PROMPTS_FILE = Path(__file__).with_name("data") / "speculator_prompts.txt"
REPORT_EVERY = 8  # progress lines: one per this many sequences
MAX_LINEAR_ERROR = 1e-3  # above this, the logits are not the lm_head's linear image of one state


@dataclass
class Corpus:
    """Sequences laid end to end: tokens [n], hidden [n, hidden]; `starts[i]` is where sequence
    i begins, `learn_from[i]` its first position whose next tokens are training targets (a
    reply's first position; 0 for text); `replies[i]` whether it is a model reply; `greedy[p]`
    the model's argmax at p, its choice for token p+1 (in a reply, token p+1 itself)."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    greedy: torch.Tensor
    starts: list[int]
    learn_from: list[int]
    replies: list[bool]
    ranking: torch.Tensor  # token ids, most frequent in the corpus first (then by id)
    inverse_rows: torch.Tensor

    def positions(self, stages: int, replies: bool) -> torch.Tensor:
        """Global indices p with p+1 .. p+stages+1 inside the same sequence, past learn_from."""
        ends = self.starts[1:] + [len(self.tokens)]
        picked = [
            torch.arange(start + first, end - stages - 1)
            for start, end, first, reply in zip(self.starts, ends, self.learn_from, self.replies)
            if reply == replies and end - stages - 1 > start + first
        ]
        return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)


def read_prompts(path: Path = PROMPTS_FILE) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def source_key(llm, texts: list[str], prompts: list[str], reply_tokens: int) -> str:
    """What identifies a corpus: the artifact's weights and graph, and the sources."""
    files = llm.manifest.get("files", {})
    parts = [
        files.get("weights.safetensors", {}).get("sha256", ""),
        llm.manifest.get("ir_hash", ""),
        json.dumps([texts, prompts, reply_tokens]),
    ]
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


def default_texts(extra_files: list[Path], base: list[str] | None = None) -> list[str]:
    """`base` (default: the bundled Moby-Dick chapters) and the text of each extra file."""
    texts = [CALIBRATION_FILE.read_text(encoding="utf-8")] if base is None else list(base)
    for path in extra_files:
        if not Path(path).is_file():
            raise SpeculatorError(f"--data {path} is not a file. Fix: give a UTF-8 text file.")
        texts.append(Path(path).read_text(encoding="utf-8"))
    return texts


def collect(
    llm,
    head: OutputHead,
    texts: list[str],
    prompts: list[str],
    reply_tokens: int,
    report=print,
    partial: tuple[Path, str] | None = None,
) -> Corpus:
    """Run the artifact over the texts and over its replies to the prompts; return the corpus.
    `partial` (a file and the corpus' key) keeps the replies decoded so far, group by group, so
    an interrupted collection resumes after its last finished group."""
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise SpeculatorError(
            "This artifact has no tokenizer, so it cannot read the training text. "
            "Fix: compile from a model directory with tokenizer.json."
        )
    chunk = min(llm.max_seq_len, 512)
    sequences = [
        (ids[i : i + chunk], 0, False)
        for text in texts
        for ids in [tokenizer.encode(text, add_special_tokens=False)]
        for i in range(0, len(ids), chunk)
    ]
    sequences += _replies(llm, prompts, reply_tokens, report, partial)
    sequences = [s for s in sequences if len(s[0]) > 1]
    ranking = frequency_ranking([s[0] for s in sequences], head.weight.shape[0])
    to_hidden = HiddenFromLogits.for_head(head, ranking)
    tokens, hidden, greedy, starts = [], [], [], []
    with llm.engine.exclusive() as executable:  # the engine forgets the rows' cached prefixes after
        for i, (ids, _, _) in enumerate(sequences):
            logits = executable.run(torch.tensor([ids]), torch.arange(len(ids))[None])[0].float()
            if i == 0:
                error = to_hidden.relative_error(head, logits)
                if error > MAX_LINEAR_ERROR:
                    raise SpeculatorError(
                        f"The artifact's logits are not its lm_head applied to one hidden state "
                        f"(relative error {error:.1e}). Fix: use prompt lookup or a draft model."
                    )
            starts.append(sum(len(t) for t in tokens))
            tokens.append(torch.tensor(ids))
            hidden.append(to_hidden(logits))
            greedy.append(logits.argmax(-1))
            if (i + 1) % REPORT_EVERY == 0 or i + 1 == len(sequences):
                report(f"hidden states {i + 1}/{len(sequences)}")
    return Corpus(
        torch.cat(tokens),
        torch.cat(hidden),
        torch.cat(greedy),
        starts,
        [s[1] for s in sequences],
        [s[2] for s in sequences],
        ranking,
        to_hidden.rows,
    )


def _replies(
    llm, prompts: list[str], reply_tokens: int, report, partial: tuple[Path, str] | None = None
) -> list[tuple[list[int], int, bool]]:
    """(prompt + greedy reply, the prompt's last position, True) per prompt; prompts go to the
    engine in groups of two batches, so it decodes them side by side and progress shows."""
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]) for prompt in prompts]
    chats = [ids for ids in chats if len(ids) < llm.max_seq_len - 1]  # room for at least one token
    group = max(4, 2 * llm.max_batch)
    sequences = _decoded_so_far(partial)
    if sequences:
        report(f"replies: resuming after {len(sequences)}/{len(chats)} ({partial[0]})")
    started, resumed = time.perf_counter(), len(sequences)
    for first in range(resumed, len(chats), group):
        batch = chats[first : first + group]
        longest = max(len(ids) for ids in batch)
        tokens = max(1, min(reply_tokens, llm.max_seq_len - longest - 1))
        for ids, reply in zip(batch, llm.generate(batch, max_new_tokens=tokens)):
            sequences.append((ids + reply.token_ids, len(ids) - 1, True))
        if partial is not None:
            torch.save({"key": partial[1], "sequences": sequences}, partial[0])
        done = first + len(batch)
        elapsed = time.perf_counter() - started
        report(f"replies {done}/{len(chats)}, ETA {_clock(elapsed / (done - resumed) * (len(chats) - done))}")
    return sequences


def _decoded_so_far(partial: tuple[Path, str] | None) -> list:
    """The replies an interrupted collection with the same key had decoded (none if another)."""
    if partial is None or not partial[0].is_file():
        return []
    try:
        saved = torch.load(partial[0], weights_only=True)
    except Exception:  # noqa: BLE001 - an unreadable file: decode again
        return []
    return [tuple(s) for s in saved["sequences"]] if saved.get("key") == partial[1] else []


def frequency_ranking(sequences: list[list[int]], vocab: int) -> torch.Tensor:
    """Every token id, the corpus' most frequent first; unseen ones after, by id (a BPE
    vocabulary's early ids are its common merges)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids in sequences:
        counts += torch.bincount(torch.tensor(ids), minlength=vocab)[:vocab]
    order = sorted(range(vocab), key=lambda token: (-int(counts[token]), token))
    return torch.tensor(order)


def save_corpus(corpus: Corpus, path: Path, key: str) -> None:
    torch.save({"key": key, **corpus.__dict__}, path)


def load_corpus(path: Path, key: str, head: OutputHead) -> Corpus | None:
    """The cached corpus at `path` if it was collected from the same artifact and sources (one
    cached before the greedy choices were kept gets them from its hidden states)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - an unreadable cache is collected again
        return None
    if not isinstance(saved, dict) or saved.pop("key", None) != key:
        return None
    if "greedy" not in saved:
        saved["greedy"] = greedy_choices(saved["hidden"], head)
    return Corpus(**saved)


def greedy_choices(hidden: torch.Tensor, head: OutputHead, rows: int = 1024) -> torch.Tensor:
    """The argmax of the logits the lm_head makes of each hidden state [n, hidden]."""
    bias = head.bias if head.bias is not None else 0
    return torch.cat([(part @ head.weight.T + bias).argmax(-1) for part in hidden.split(rows)])


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s"
