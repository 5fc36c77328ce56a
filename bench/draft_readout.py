"""What a draft costs against what it wins: draft vocabulary size, int8 weights and token trees.

    .venv/bin/python bench/draft_readout.py [--artifact out/bench-spec-inductor.kiln] [--kind eagle]

For the trained heads stored in the artifact, each setting of `DraftSettings` (the draft
vocabulary cut to its most frequent N tokens, int8 weights or fp32, a chain or a tree grown from
the draft's probabilities) is scored offline on the held-out tenth of the corpus' replies that
`kiln train-speculator` collected (ARTIFACT.speculator/corpus.pt): the tokens the target would
accept per draft (the longest path of the draft that is the model's own greedy continuation),
the draft's size (what the verifying step feeds), and the milliseconds one draft takes on one
thread (the drafter's setting), timed over the same positions. The target's cost of verifying a
wider step is not here: bench/speculative.py measures the whole. Writes
bench/results/draft_readout.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from provenance import write_result

RESULTS = Path(__file__).parent / "results"


def accepted_length(tree, truth: list[int]) -> int:
    """How far greedy verification walks into `tree` when the model's choices are `truth`."""
    at, length = -1, 0
    for token in truth:
        hit = next((c for c in tree.children(at) if tree.tokens[c] == token), None)
        if hit is None:
            break
        at, length = hit, length + 1
    return length


def score(drafter, corpus, positions: torch.Tensor, stages: int) -> tuple[float, float, float]:
    """(tokens accepted per draft, nodes per draft, draft ms) over `positions`."""
    accepted, nodes, seconds = 0, 0, 0.0
    for p in positions.tolist():
        drafter.hidden = corpus.hidden[p]
        truth = corpus.greedy[p + 1 : p + 1 + stages].tolist()
        start = time.perf_counter()
        tree = drafter.propose([int(corpus.tokens[p + 1])], stages)
        seconds += time.perf_counter() - start
        accepted += accepted_length(tree, truth)
        nodes += len(tree)
    count = len(positions)
    return accepted / count, nodes / count, 1e3 * seconds / count


def main(argv=None) -> int:
    import kiln
    from kiln import speculator_data as data
    from kiln.runtime.heads_drafter import DraftSettings, HeadsDrafter
    from kiln.runtime.last_hidden import output_head
    from kiln.train_speculator import work_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default="out/bench-spec-inductor.kiln")
    parser.add_argument("--kind", default="eagle")
    parser.add_argument("--positions", type=int, default=400, help="held-out positions scored per setting")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    artifact = Path(args.artifact)
    llm = kiln.load(artifact)
    saved = torch.load(work_dir(artifact) / "corpus.pt", weights_only=True)
    saved.pop("key", None)
    if "greedy" not in saved:
        saved["greedy"] = data.greedy_choices(saved["hidden"], output_head(llm.graph))
    corpus = data.Corpus(**saved)
    stages = int(llm.manifest["speculators"][args.kind]["stages"])
    replies = corpus.positions(stages, replies=True)
    held_out = replies[len(replies) - max(1, len(replies) // 10) :]
    positions = held_out[torch.linspace(0, len(held_out) - 1, min(args.positions, len(held_out))).long()]
    settings = [
        DraftSettings(vocab=vocab, int8=int8, tree_nodes=0, alternatives=0)
        for vocab in (None, 4096, 2048, 1024)
        for int8 in (False, True)
    ]
    if args.kind == "eagle":
        settings += [
            DraftSettings(vocab=vocab, int8=True, tree_top_k=top_k, tree_nodes=nodes)
            for vocab in (4096, 2048)
            for top_k, nodes in ((2, 6), (3, 8), (4, 8), (4, 12), (6, 16))
        ]
        settings += [
            DraftSettings(vocab=2048, int8=True, tree_top_k=3, tree_nodes=8, tree_min_probability=floor)
            for floor in (0.05, 0.15)
        ]
    lines = [
        "| draft vocabulary | weights | draft | tokens accepted per draft | nodes per draft | draft ms |",
        "| ---: | --- | --- | ---: | ---: | ---: |",
    ]
    for setting in settings:
        drafter = HeadsDrafter.from_artifact(artifact, llm.manifest, llm.graph, args.kind, setting)
        accepted, nodes, ms = score(drafter, corpus, positions, stages)
        shape = f"tree top-{setting.tree_top_k}, {setting.tree_nodes} nodes" if setting.tree_nodes else "chain"
        shape += f", p >= {setting.tree_min_probability}" if setting.tree_nodes and setting.tree_min_probability else ""
        line = (
            f"| {len(drafter.heads.vocab_ids)} | {'int8' if setting.int8 else 'fp32'} | {shape} | "
            f"{accepted:.3f} | {nodes:.1f} | {ms:.2f} |"
        )
        print(line, flush=True)
        lines.append(line)
    training = llm.manifest["speculators"][args.kind].get("training", {})
    report = "\n".join(lines) + (
        f"\n\n{args.kind} heads of {artifact} ({stages} stages; training {training.get('config')}), "
        f"{len(positions)} held-out reply positions of {len(held_out)}, one thread. A chain here is "
        "the greedy chain alone; `tokens accepted per draft` is what greedy verification would "
        "accept of it (the target's own token after it comes on top).\n"
    )
    write_result(RESULTS / "draft_readout.md", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
