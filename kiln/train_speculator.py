"""`kiln train-speculator ARTIFACT`: train draft heads for speculative decoding, on the CPU.

    kiln train-speculator model.kiln [--kind eagle|mlp|medusa] [--stages 4] [--steps 1000] [--data FILE ...]

Collects the artifact's own hidden states (kiln/speculator_data.py: the bundled text, then the
model's greedy replies to chat prompts), trains the heads with AdamW on the sum of the stages'
cross-entropies, first on text, then on the replies (IBM's two phases), and writes them into
the artifact (speculator.KIND.safetensors, hashed in the manifest), with the replies themselves
(speculator.replies.safetensors: what "heads+lookup" also drafts from, runtime/reply_index.py). One progress line per
`--log-every` steps with the loss, each stage's accuracy and an ETA. Interrupted (Ctrl-C, a
killed process), it resumes from its last checkpoint: the collected corpus and a training
checkpoint live in ARTIFACT.speculator/ beside the artifact until training ends. Eagle heads
with `--context whole` attend over every earlier position and train on whole sequences
(kiln/eagle_sequence_trainer.py; `--window`, `--windows`, `--noise`).

Then `llm.generate(prompt, speculative="heads")` drafts with them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.ir.errors import OptionError

KINDS = ("mlp", "medusa", "eagle")
HEAD_CHOICES = ("own", "tied")


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "mlp"
    stages: int = 4
    head: str = "own"  # own | tied (see speculator_heads.py); eagle reads through the model's lm_head: tied
    draft_vocab: int = 8192  # the most frequent tokens the heads can draft (0: every token)
    steps: int = 1000
    batch: int = 64
    lr: float = 1e-3
    text_fraction: float = 0.4  # the share of steps on text before the replies
    reply_tokens: int = 192  # the replies are most of the collection time: 192 prompts x 192 ~ 15 min at 40 tokens/s
    prompts: int = 192  # chat prompts replied to: the bundled 192, then generated ones (speculator_prompts.py)
    seed: int = 0
    # eagle: what the draft layer attends over (eagle_heads.py): "whole" trains on whole sequences
    # (`windows` stretches of at most `window` tokens per step), "draft" on sampled positions;
    # "draft" stays the default: on SmolLM2's default corpus whole-context heads guessed less
    # often (docs/generation.md)
    context: str = "draft"
    window: int = 256
    windows: int = 4
    noise: float = 0.0  # "whole": uniform noise on the real states fed in, relative to their RMS
    soft_targets: bool = True  # cross-entropy against the model's distribution (EAGLE's), not its argmax alone

    def check(self) -> None:
        if self.kind not in KINDS:
            raise OptionError(f"--kind {self.kind!r} is not one of {list(KINDS)}. Fix: --kind mlp.")
        if self.head not in HEAD_CHOICES:
            raise OptionError(f"--head {self.head!r} is not one of {list(HEAD_CHOICES)}. Fix: --head own.")
        from kiln.runtime.eagle_heads import CONTEXTS

        if self.context not in CONTEXTS:
            raise OptionError(f"--context {self.context!r} is not whole or draft. Fix: --context whole.")
        if self.window < 2 or self.windows < 1 or self.noise < 0:
            raise OptionError(
                f"--window must be at least 2, --windows at least 1 and --noise >= 0, got {self.window}, "
                f"{self.windows} and {self.noise}. Fix: e.g. --window 256 --windows 4 --noise 0."
            )
        if self.kind == "eagle" and self.head != "tied":
            raise OptionError("eagle heads read out through the model's own lm_head. Fix: --head tied.")
        from kiln.speculator_prompts import most_prompts

        most = most_prompts()
        if not 1 <= self.prompts <= most:
            raise OptionError(
                f"--prompts must be within 1..{most} (the bundled prompts and the generated ones), "
                f"got {self.prompts}. Fix: e.g. --prompts 960."
            )
        for name in ("stages", "steps", "batch", "reply_tokens"):
            if getattr(self, name) < 1:
                flag = f"--{name.replace('_', '-')}"
                raise OptionError(
                    f"{flag} must be at least 1, got {getattr(self, name)}. Fix: pass a positive number ({flag} N)."
                )
        if self.draft_vocab < 0 or not 0 <= self.text_fraction <= 1 or not self.lr > 0:
            raise OptionError(
                "--draft-vocab must be >= 0 (0: all tokens), --text-fraction within [0, 1] and "
                "--lr positive. Fix: e.g. --draft-vocab 8192 --text-fraction 0.4 --lr 1e-3."
            )


def work_dir(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".speculator")


def train_speculator(
    llm,
    artifact: Path,
    config: TrainConfig,
    data_files=(),
    prompts: list[str] | None = None,
    texts: list[str] | None = None,
    report=print,
    log_every: int = 50,
    checkpoint_every: int = 100,
    collect_with=None,
) -> dict:
    """Train heads of `config.kind` for the loaded `llm` (from `artifact`) and store them there;
    returns the training summary recorded in the manifest. `prompts` and `texts` replace the
    bundled chat prompts and text; `data_files` add text; `collect_with` (a loaded artifact of
    the same checkpoint, e.g. one compiled with a larger max_batch) runs the collection instead."""
    import torch

    from kiln.eagle_sequence_trainer import SequenceTrainer
    from kiln.runtime.last_hidden import output_head
    from kiln.runtime.reply_index import save_replies
    from kiln.runtime.speculator_heads import build_heads, save_heads
    from kiln.speculator_trainer import Trainer, vocab_index

    config.check()
    started, cpu_started = time.perf_counter(), time.process_time()
    head = output_head(llm.graph)
    corpus = _corpus(llm, head, artifact, config, data_files, prompts, texts, report, collect_with)
    vocab_ids = corpus.ranking[: config.draft_vocab] if config.draft_vocab else corpus.ranking
    torch.manual_seed(config.seed)
    heads = build_heads(config.kind, head, config.stages, vocab_ids, config.head, config.context)
    targets = vocab_index(vocab_ids, head.weight.shape[0])
    whole = config.kind == "eagle" and config.context == "whole"
    trainer = (SequenceTrainer if whole else Trainer)(heads, corpus, targets, config, head)
    checkpoint = work_dir(artifact) / f"checkpoint.{config.kind}.pt"
    trainer.resume(checkpoint, report)
    trainer.run(report, log_every, lambda: trainer.save(checkpoint), checkpoint_every)
    accuracy, accepted = trainer.evaluate()
    summary = {
        "steps": config.steps,
        "loss": round(trainer.last_loss, 4),
        "stage_accuracy": [round(a, 3) for a in accuracy],
        "accepted_per_draft": round(accepted, 3),
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "cpu_minutes": round((time.process_time() - cpu_started) / 60, 1),
        "config": dataclasses.asdict(config),
    }
    save_heads(heads, corpus.inverse_rows, artifact, llm.manifest.get("source_hash"), summary)
    replies = corpus.reply_tokens()
    if replies:  # what speculative="heads+lookup" also looks up (runtime/reply_index.py)
        save_replies(replies, artifact, llm.manifest.get("source_hash"))
    checkpoint.unlink(missing_ok=True)
    report(
        f"wrote {artifact}/speculator.{config.kind}.safetensors: held out, accuracy per stage "
        f"{summary['stage_accuracy']}, {accepted:.2f} of {config.stages} drafts accepted; {summary['minutes']} min"
    )
    return summary


def _corpus(llm, head, artifact: Path, config: TrainConfig, data_files, prompts, texts, report, collect_with=None):
    from kiln import speculator_data as data
    from kiln.runtime.last_hidden import SpeculatorError
    from kiln.speculator_prompts import prompts_for

    texts = data.default_texts(list(data_files), texts)
    prompts = prompts_for(config.prompts, data.read_prompts()) if prompts is None else prompts
    key = data.source_key(llm, texts, prompts, config.reply_tokens)
    path = work_dir(artifact) / "corpus.pt"
    corpus = data.load_corpus(path, key, head)
    if corpus is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        collector = collect_with or llm
        if collector.manifest.get("source_hash") != llm.manifest.get("source_hash"):
            raise SpeculatorError(
                "--collect-with names an artifact of another checkpoint (its source_hash differs). "
                "Fix: compile the same model again with a larger --max-batch and collect with that."
            )
        store = data.ReplyStore(path.with_name("replies.pt"), data.reply_key(llm, config.reply_tokens))
        corpus = data.collect(collector, head, texts, prompts, config.reply_tokens, report, store)
        data.save_corpus(corpus, path, key)
    report(f"corpus: {len(corpus.tokens)} tokens in {len(corpus.starts)} sequences ({sum(corpus.replies)} replies)")
    return corpus


# -- the command line --------------------------------------------------------------------------
def add_arguments(commands) -> None:
    """The `kiln train-speculator` subcommand."""
    defaults = TrainConfig()
    parser = commands.add_parser("train-speculator", help="train draft heads for speculative='heads' (CPU)")
    parser.add_argument("artifact")
    parser.add_argument(
        "--kind", default="eagle", help=f"one of {', '.join(KINDS)} (default eagle: it drafts the longest chains)"
    )
    parser.add_argument("--stages", type=int, default=defaults.stages, help="tokens drafted per step")
    parser.add_argument(
        "--head",
        default=None,
        help="own: trained vocabulary heads; tied: the model's lm_head rows (default: own, for eagle tied)",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=defaults.draft_vocab,
        help="how many of the most frequent tokens the heads can draft (0: all)",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument(
        "--text-fraction",
        type=float,
        default=defaults.text_fraction,
        help="the share of steps on text before the model's own replies",
    )
    parser.add_argument(
        "--reply-tokens",
        type=int,
        default=defaults.reply_tokens,
        help="tokens of each reply to the chat prompts",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=defaults.prompts,
        help="chat prompts whose replies the heads learn from: the bundled 192, then generated ones",
    )
    parser.add_argument(
        "--context",
        default=defaults.context,
        help="eagle: draft (the layer attends over the draft's own positions; the default) or whole (over "
        "every earlier position, trained on whole sequences)",
    )
    parser.add_argument("--window", type=int, default=defaults.window, help="whole context: tokens per stretch")
    parser.add_argument("--windows", type=int, default=defaults.windows, help="whole context: stretches per step")
    parser.add_argument(
        "--noise", type=float, default=defaults.noise, help="whole context: noise on the states fed in (EAGLE's)"
    )
    parser.add_argument(
        "--targets",
        choices=("soft", "greedy"),
        default="soft" if defaults.soft_targets else "greedy",
        help="soft: learn the model's distribution at each position (EAGLE's loss; the default); "
        "greedy: its argmax alone",
    )
    parser.add_argument("--data", action="append", default=[], help="more training text (a UTF-8 file; repeatable)")
    parser.add_argument(
        "--collect-with",
        default=None,
        help="an artifact of the same checkpoint with a larger max_batch, to decode the replies side by side",
    )
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: one per core; on a machine others keep busy, 1 is often faster)",
    )


def run_command(args) -> int:
    config = TrainConfig(
        kind=args.kind,
        stages=args.stages,
        head=args.head or ("tied" if args.kind == "eagle" else TrainConfig.head),
        draft_vocab=args.draft_vocab,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        text_fraction=args.text_fraction,
        reply_tokens=args.reply_tokens,
        prompts=args.prompts,
        seed=args.seed,
        context=args.context,
        window=args.window,
        windows=args.windows,
        noise=args.noise,
        soft_targets=args.targets == "soft",
    )
    config.check()
    if args.log_every < 1 or (args.threads is not None and args.threads < 1):
        raise OptionError(
            f"--log-every and --threads must be at least 1, got {args.log_every} and {args.threads}. "
            "Fix: pass positive numbers (or leave them out)."
        )
    import torch

    import kiln

    artifact = Path(args.artifact)
    llm = kiln.load(artifact)
    if args.threads:
        torch.set_num_threads(args.threads)
    collector = kiln.load(args.collect_with) if args.collect_with else None
    train_speculator(
        llm,
        artifact,
        config,
        args.data,
        report=lambda line: print(line, flush=True),
        log_every=args.log_every,
        collect_with=collector,
    )
    return 0
