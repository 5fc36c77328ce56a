"""How often do an artifact's draft heads guess what the model says? Per stage, on SmolLM2-135M.

    .venv/bin/python bench/speculator_accuracy.py [--artifact out/bench-spec-inductor.kiln] [--kind mlp]

No timing: it measures, for each stage of the heads, the teacher-forced top-1 accuracy against
the model's own greedy choices (what greedy verification accepts), and the tokens of the heads'
own chain that match, on three sets:
- training positions: the corpus `kiln train-speculator` collected (ARTIFACT.speculator/corpus.pt),
  its text and its replies apart (the replies' held-out tenth included);
- fresh replies: the model's greedy answers to prompts the corpus does not hold (bench/speculative.py's
  code edit and prose prompts among them), hidden states solved from the artifact's logits as
  the drafter does;
- the runtime: `generate(speculative=...)` on those prompts, counting per verified draft how many
  tokens the target accepted (it must agree with the offline chain on fresh replies).
A large gap between training and fresh accuracy is overfitting; a training accuracy near zero
against the model's choices is misaligned targets. Writes bench/results/speculator_accuracy.md
(or --out NAME there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from provenance import write_result
from speculative import CODE_PROMPT, PROSE_PROMPT

RESULTS = Path(__file__).parent / "results"
FRESH_PROMPTS = [
    CODE_PROMPT,
    PROSE_PROMPT,
    "Describe how bees make honey.",
    "Write a Python function that merges two sorted lists.",
]


def scores(heads, tokens, hidden, greedy, positions, spans) -> tuple[list[float], float]:
    """(accuracy per stage, chain tokens accepted per draft) at `positions` of one token stream;
    heads attending over the whole context read each draft's sequence before it (`spans`: the
    sequences' (start, end, first draft start), whose drafts are `positions`)."""
    if getattr(heads, "context", None) == "whole":
        from types import SimpleNamespace

        from kiln.eagle_sequence_trainer import draft_scores

        stream = SimpleNamespace(tokens=tokens, hidden=hidden, greedy=greedy)
        with torch.no_grad():
            accuracy, chain, _ = draft_scores(heads, stream, spans)
        return accuracy, chain
    after = positions[:, None] + torch.arange(1, heads.stages + 1)  # t_{p+1} .. t_{p+stages}
    fed, wanted = tokens[after], greedy[after]
    with torch.no_grad():
        picks = [heads.vocab_ids[out.argmax(-1)] for out in heads(hidden[positions], fed)]
    accuracy = [float((pick == wanted[:, i]).float().mean()) for i, pick in enumerate(picks)]
    chain = heads.chains(hidden[positions], fed[:, 0]) == wanted
    return accuracy, float(chain.long().cumprod(dim=1).sum(dim=1).float().mean())


def row(name: str, count: int, accuracy: list[float], chain: float, runtime: str = "") -> str:
    stages = " / ".join(f"{a:.2f}" for a in accuracy)
    return f"| {name} | {count} | {stages} | {chain:.2f} | {runtime} |"


class CountingDrafter:
    """Passes a drafter through, keeping how many tokens of each verified draft were accepted."""

    def __init__(self, inner):
        self.inner, self.accepted = inner, []

    def observe(self, logits):
        self.inner.observe(logits)

    def observe_rows(self, logits, first):
        self.inner.observe_rows(logits, first)

    @property
    def reads_prompt(self):
        return getattr(self.inner, "reads_prompt", False)

    def propose(self, context, max_tokens):
        return self.inner.propose(context, max_tokens)

    def feedback(self, drafted, accepted):
        self.accepted.append(accepted)
        self.inner.feedback(drafted, accepted)


def fresh_rows(llm, heads, to_hidden, kind: str, tokens: int) -> list[str]:
    rows = []
    for text in FRESH_PROMPTS:
        prompt = llm.encode_chat([{"role": "user", "content": text}])
        plain = llm.generate(prompt, max_new_tokens=tokens)
        ids = torch.tensor(prompt + plain.token_ids)
        with llm.engine.exclusive() as executable:
            logits = executable.run(ids[None], torch.arange(len(ids))[None])[0].float()
        positions = torch.arange(len(prompt) - 1, len(ids) - heads.stages - 1)
        spans = [(0, len(ids), len(prompt) - 1)]
        accuracy, chain = scores(heads, ids, to_hidden(logits), logits.argmax(-1), positions, spans)
        drafter = CountingDrafter(llm.heads.drafter(kind))
        result = llm.generate(prompt, max_new_tokens=tokens, speculative=drafter)
        same = "same as plain" if result.token_ids == plain.token_ids else "DIFFERS from plain"
        runtime = f"{sum(drafter.accepted) / max(1, len(drafter.accepted)):.2f} per draft, {same}"
        rows.append(row(f"fresh: {text.splitlines()[0][:40]}", len(positions), accuracy, chain, runtime))
    return rows


def main(argv=None) -> int:
    import kiln
    from kiln import speculator_data as data
    from kiln.runtime.last_hidden import HiddenFromLogits, output_head
    from kiln.runtime.speculator_heads import load_heads
    from kiln.train_speculator import work_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default="out/bench-spec-inductor.kiln")
    parser.add_argument("--kind", default="mlp")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="speculator_accuracy.md", help="the results file's name in bench/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    artifact = Path(args.artifact)
    llm = kiln.load(artifact)
    head = output_head(llm.graph)
    heads, rows = load_heads(artifact, llm.manifest, head, args.kind)
    lines = [
        "| positions | count | top-1 accuracy per stage | chain tokens accepted per draft | runtime |",
        "| --- | ---: | --- | ---: | --- |",
    ]
    saved = torch.load(work_dir(artifact) / "corpus.pt", weights_only=True)
    saved.pop("key", None)
    if "greedy" not in saved:  # a corpus collected before the greedy choices were kept
        saved["greedy"] = data.greedy_choices(saved["hidden"], head)
    corpus = data.Corpus(**saved)
    ends = corpus.starts[1:] + [len(corpus.tokens)]
    for replies, name in ((False, "training: text"), (True, "training: replies")):
        positions = corpus.positions(heads.stages, replies)
        spans = [
            (start, end, start + first)
            for start, end, first, reply in zip(corpus.starts, ends, corpus.learn_from, corpus.replies)
            if reply == replies
        ]
        if len(positions):
            accuracy, chain = scores(heads, corpus.tokens, corpus.hidden, corpus.greedy, positions, spans)
            lines.append(row(name, len(positions), accuracy, chain))
    lines += fresh_rows(llm, heads, HiddenFromLogits(head, rows), args.kind, args.tokens)
    training = llm.manifest["speculators"][heads.kind].get("training", {})
    context = f", {heads.context} context" if hasattr(heads, "context") else ""
    report = "\n".join(lines) + (
        f"\n\n{heads.kind} heads of {artifact} ({heads.stages} stages{context}, head {heads.head_choice}, draft "
        f"vocabulary {len(heads.vocab_ids)}); training: {training.get('config')}, "
        f"{training.get('cpu_minutes')} CPU minutes. Accuracy is against the model's greedy choices; "
        "`runtime`: tokens the target accepted per verified draft in generate(speculative=...).\n"
    )
    print(report)
    write_result(RESULTS / args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
