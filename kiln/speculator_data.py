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
collection. The replies are also kept on their own (`ReplyStore`), keyed by the weights and the
reply length alone: a collection over more prompts decodes only the new ones (decoding is most of
a collection's time), and an interrupted one resumes after its last finished group.
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

    def reply_tokens(self) -> list[list[int]]:
        """Each reply's own tokens (after its prompt)."""
        ends = self.starts[1:] + [len(self.tokens)]
        return [
            self.tokens[start + first + 1 : end].tolist()
            for start, end, first, reply in zip(self.starts, ends, self.learn_from, self.replies)
            if reply
        ]

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
    return _key(llm, json.dumps([texts, prompts, reply_tokens]))


def reply_key(llm, reply_tokens: int) -> str:
    """What identifies the model's replies: its weights and graph, and their length."""
    return _key(llm, str(reply_tokens))


def _key(llm, sources: str) -> str:
    files = llm.manifest.get("files", {})
    parts = [files.get("weights.safetensors", {}).get("sha256", ""), llm.manifest.get("ir_hash", ""), sources]
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
    store: ReplyStore | None = None,
) -> Corpus:
    """Run the artifact over the texts and over its replies to the prompts; return the corpus.
    `store` keeps the replies decoded, group by group, and gives back those decoded before."""
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
    sequences += _replies(llm, prompts, reply_tokens, report, store)
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


class ReplyStore:
    """The model's greedy replies decoded so far, by chat (its token ids), in one file: `key`
    names the model and the reply length (`reply_key`), so the replies are
    reused whatever the prompt list; a file of another key, or one that cannot be read, is
    started afresh. Greedy decoding gives a chat the same reply alone or in any batch."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        self.replies = self._read()

    def _read(self) -> dict[tuple[int, ...], list[int]]:
        if not self.path.is_file():
            return {}
        try:
            saved = torch.load(self.path, weights_only=True)
        except Exception:  # noqa: BLE001 - an unreadable file: decode again
            return {}
        if not isinstance(saved, dict) or saved.get("key") != self.key:
            return {}
        return {tuple(chat): list(reply) for chat, reply in saved.get("replies", [])}

    def save(self) -> None:
        replies = [[list(chat), reply] for chat, reply in self.replies.items()]
        partial = self.path.with_name(self.path.name + ".partial")
        torch.save({"key": self.key, "replies": replies}, partial)
        partial.replace(self.path)  # whole or not at all, should the process die while writing


def _replies(
    llm, prompts: list[str], reply_tokens: int, report, store: ReplyStore | None = None
) -> list[tuple[list[int], int, bool]]:
    """(prompt + greedy reply, the prompt's last position, True) per prompt; the replies not in
    `store` go to the engine in groups of two batches, so it decodes them side by side and
    progress shows, and each group is added to the store as it finishes."""
    chats = [llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]) for prompt in prompts]
    chats = [ids for ids in chats if len(ids) < llm.max_seq_len - 1]  # room for at least one token
    group = max(4, 2 * llm.max_batch)
    replies = dict(store.replies) if store is not None else {}
    distinct = list(dict.fromkeys(tuple(ids) for ids in chats))
    todo = [chat for chat in distinct if chat not in replies]
    known = len(distinct) - len(todo)
    if known:
        report(f"replies: {known}/{len(distinct)} decoded before ({store.path})")
    started = time.perf_counter()
    for first in range(0, len(todo), group):
        batch = todo[first : first + group]
        longest = max(len(chat) for chat in batch)
        tokens = max(1, min(reply_tokens, llm.max_seq_len - longest - 1))
        for chat, reply in zip(batch, llm.generate([list(chat) for chat in batch], max_new_tokens=tokens)):
            replies[chat] = reply.token_ids
            if store is not None and tokens == reply_tokens:  # a reply cut shorter is this artifact's alone
                store.replies[chat] = reply.token_ids
        if store is not None:
            store.save()
        done = first + len(batch)
        elapsed = time.perf_counter() - started
        report(f"replies {known + done}/{len(distinct)}, ETA {_clock(elapsed / done * (len(todo) - done))}")
    return [(ids + replies[tuple(ids)], len(ids) - 1, True) for ids in chats]


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
