"""Which vocabulary head should draft heads have? Draft cost against acceptance, on SmolLM2-135M.

    .venv/bin/python bench/speculator_heads.py [--artifact out/bench-spec-inductor.kiln] [--steps 200]

Needs the corpus `kiln train-speculator ARTIFACT` collected (ARTIFACT.speculator/corpus.pt).
For each draft vocabulary size it reports what one 4-stage mlp draft costs (median ms, one
thread and two) and the share of held-out reply tokens the vocabulary covers (the ceiling on
acceptance); for the restricted sizes it trains the own and the tied head for the same number
of steps and reports the held-out tokens accepted per draft (the heads' own greedy chain
against what the model said). Writes bench/results/speculator_heads.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CpuMeter
from provenance import write_result

RESULTS = Path(__file__).parent / "results"


def draft_ms(heads, corpus, threads: int, repeats: int = 30) -> float:
    torch.set_num_threads(threads)
    hidden, token = corpus.hidden[100], int(corpus.tokens[101])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        heads.draft(hidden, token, heads.stages)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def main(argv=None) -> int:
    import kiln
    from kiln import speculator_data as data
    from kiln.runtime.last_hidden import output_head
    from kiln.runtime.speculator_heads import build_heads
    from kiln.speculator_trainer import Trainer, vocab_index
    from kiln.train_speculator import TrainConfig, work_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default="out/bench-spec-inductor.kiln")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sizes", default="2048,8192,0", help="draft vocabulary sizes (0: every token)")
    args = parser.parse_args(argv)
    artifact = Path(args.artifact)
    llm = kiln.load(artifact)
    head = output_head(llm.graph)
    saved = torch.load(work_dir(artifact) / "corpus.pt", weights_only=True)
    saved.pop("key")
    if "greedy" not in saved:  # a corpus collected before the greedy choices were kept
        saved["greedy"] = data.greedy_choices(saved["hidden"], head)
    corpus = data.Corpus(**saved)
    replies = corpus.positions(4, replies=True)
    held = replies[len(replies) - len(replies) // 10 :]
    lines = [
        "| draft vocabulary | head | draft ms (1 thread) | draft ms (2 threads) | reply tokens covered | "
        "accepted per 4-token draft | others' cores |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in (int(s) for s in args.sizes.split(",")):
        vocab_ids = corpus.ranking[:size] if size else corpus.ranking
        covered = float(torch.isin(corpus.tokens[held + 2], vocab_ids).float().mean())
        for choice in ("own", "tied"):
            torch.manual_seed(0)
            heads = build_heads("mlp", head, 4, vocab_ids, choice)
            with CpuMeter() as meter:
                accepted = "(not trained: full-vocabulary steps cost 6x)"
                if size:
                    torch.set_num_threads(1)
                    config = TrainConfig(head=choice, draft_vocab=size, steps=args.steps)
                    trainer = Trainer(heads, corpus, vocab_index(vocab_ids, head.weight.shape[0]), config, head)
                    tag = f"[{size} {choice}]"
                    trainer.run(lambda line, tag=tag: print(f"{tag} {line}", flush=True), 50, lambda: None, 10**9)
                    accepted = f"{trainer.evaluate()[1]:.2f}"
                one, two = draft_ms(heads, corpus, 1), draft_ms(heads, corpus, 2)
            lines.append(
                f"| {size or len(corpus.ranking)} | {choice} | {one:.2f} | {two:.2f} | {covered:.1%} | "
                f"{accepted} | {meter.result.other_cores:.2f} |"
            )
            print(lines[-1], flush=True)
    report = (
        "\n".join(lines) + f"\n\nmlp heads, 4 stages, {args.steps} training steps each (batch 64), "
        "SmolLM2-135M-Instruct; `others' cores`: how many cores other processes kept busy meanwhile.\n"
    )
    print(report)
    write_result(RESULTS / "speculator_heads.md", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
