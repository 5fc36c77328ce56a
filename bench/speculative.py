"""Speculative decoding on SmolLM2-135M: plain greedy vs prompt lookup vs a quantized self-draft
vs trained draft heads vs the heads, prompt lookup and the model's stored replies merged into one
tree (heads+lookup).

    .venv/bin/python bench/speculative.py [--backend inductor] [--draft-quantize int4-g64] [--tokens 96]
        [--target ARTIFACT] [--heads-from ARTIFACT] [--kinds eagle] [--methods WORD,..] [--out NAME.md]

Two prompts: a code-editing one (the answer repeats most of the prompt: prompt lookup's case)
and free prose. For each, it prints decode tokens/s (and the ratio to plain greedy in the same
run), the acceptance rate and the tokens per target step, checks that greedy output is identical
to plain decoding, and writes bench/results/speculative.md. The draft is the same checkpoint
compiled with a low-bit scheme (skipped with a note if that scheme does not compile on the
chosen backend). Heads are benchmarked when the target artifact has them
(`kiln train-speculator out/bench-spec-inductor.kiln [--kind medusa]`); `--heads-from ARTIFACT`
adds the eagle heads of another artifact of the same checkpoint beside them (e.g. heads trained
with another --context), `--kinds` picks the kinds measured. Each row records how many cores
other processes kept busy while it ran (the machine may be shared).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_contention import CONTENDED_CORES, CpuMeter
from provenance import write_result

RESULTS = Path(__file__).parent / "results"
CODE_PROMPT = """Rename the variable `total` to `running_sum` in this function and return the code.

```python
def mean(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    if count == 0:
        return 0.0
    return total / count
```
"""
PROSE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def compiled(out: Path, backend: str, quantize: str | None):
    import kiln

    if not (out / "manifest.json").exists():
        kwargs = {"quantize": quantize} if quantize else {}
        kiln.compile(None, out=out, backend=backend, max_seq_len=512, max_batch=1, **kwargs)
    return kiln.load(out)


CHAIN_LOOKUP = "prompt_lookup chain"  # prompt lookup in the engine, its most recent match alone


@contextmanager
def lookup_branches(speculative):
    """Prompt lookup drafting one chain instead of a tree, for `CHAIN_LOOKUP`."""
    import kiln.runtime.drafters as drafters  # where engine_drafter finds it

    saved = drafters.PromptLookupDrafter
    if speculative == CHAIN_LOOKUP:
        drafters.PromptLookupDrafter = functools.partial(saved, branches=1)
    try:
        yield "prompt_lookup" if speculative == CHAIN_LOOKUP else speculative
    finally:
        drafters.PromptLookupDrafter = saved


def run(llm, prompt: list[int], tokens: int, speculative) -> tuple[object, float, float]:
    with (
        lookup_branches(speculative) as speculative,
        engine_heads(llm, speculative) as speculative,  # loads the heads (compiling their step) first
        CpuMeter() as meter,
    ):
        start = time.perf_counter()
        result = llm.generate(prompt, max_new_tokens=tokens, speculative=speculative)
        seconds = time.perf_counter() - start
    return result, seconds, meter.result.other_cores


class EngineHeads:
    """Heads drafting inside the engine (trees where the backend verifies them) with `settings`
    (kiln.runtime.heads_drafter.DraftSettings), each request's drafter timed (`drafter`); `stored`:
    another artifact's heads (kiln.runtime.drafters.StoredHeads; None: the target's)."""

    def __init__(self, kind: str, settings, stored=None, lookup: dict | None = None, replies: dict | None = None):
        self.kind, self.settings, self.drafter, self.stored = kind, settings, None, stored
        # merged with prompt lookup's drafts ("heads:KIND+lookup"), its PromptLookupDrafter's arguments,
        # and the model's replies stored beside the heads (`replies`: ReplyIndex settings; None: without)
        self.lookup, self.replies = lookup, replies


@contextmanager
def engine_heads(llm, speculative):
    """For an EngineHeads: speculative="heads:KIND" (or "heads:KIND+lookup") with its settings,
    its heads' drafters timed."""
    if not isinstance(speculative, EngineHeads):
        yield speculative
        return
    from kiln.runtime import heads_drafter, lookup_heads_drafter

    saved, own, lookup = heads_drafter.DEFAULT_SETTINGS, llm.heads, lookup_heads_drafter.PromptLookupDrafter
    if speculative.lookup:
        lookup_heads_drafter.PromptLookupDrafter = functools.partial(lookup, **speculative.lookup)
    stored = llm.heads = speculative.stored or own
    index, index_saved = stored.reply_index(), {}
    if speculative.replies is None:
        stored.reply_index = lambda: None
    elif index is not None:
        index_saved = {name: getattr(index, name) for name in speculative.replies}
        vars(index).update(speculative.replies)
    heads_drafter.DEFAULT_SETTINGS = speculative.settings
    stored._loaded.pop(speculative.kind, None)  # loaded again with these settings
    make = stored.drafter
    make(speculative.kind)  # loaded (and its step compiled) before the run is timed

    def timed(kind):
        speculative.drafter = TimedDrafter(make(kind))
        return speculative.drafter

    stored.drafter = timed
    try:
        yield f"heads:{speculative.kind}" + ("+lookup" if speculative.lookup is not None else "")
    finally:
        lookup_heads_drafter.PromptLookupDrafter = lookup
        del stored.drafter
        stored.__dict__.pop("reply_index", None)
        if index is not None:
            vars(index).update(index_saved)
        stored._loaded.pop(speculative.kind, None)
        heads_drafter.DEFAULT_SETTINGS = saved
        llm.heads = own


class TimedDrafter:
    """A drafter that adds up the time its inner drafter spends (solving states and drafting)
    and counts, per verified draft, how many of its tokens the target accepted."""

    def __init__(self, inner):
        self.inner, self.seconds, self.accepted = inner, 0.0, []

    @classmethod
    def heads(cls, llm, kind: str, stored=None) -> TimedDrafter:
        """The stored heads (`stored`, else the target's) as trained (fp32, their whole draft
        vocabulary), drafting chains."""
        from kiln.runtime.heads_drafter import DraftSettings, HeadsDrafter

        as_trained = DraftSettings(vocab=None, int8=False, tree_nodes=0, alternatives=0, pause_below=0.0)
        stored = stored or llm.heads
        return cls(HeadsDrafter.from_artifact(stored.directory, stored.manifest, stored.graph, kind, as_trained))

    def _timed(self, method, *args):
        start = time.perf_counter()
        try:
            return getattr(self.inner, method)(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def propose(self, context, max_tokens):
        return self._timed("propose", context, max_tokens)

    def observe(self, logits):
        return self._timed("observe", logits)

    def observe_rows(self, logits, first):
        return self._timed("observe_rows", logits, first)

    @property
    def reads_prompt(self):
        return getattr(self.inner, "reads_prompt", False)

    def feedback(self, drafted, accepted):
        self.accepted.append(accepted)
        return self.inner.feedback(drafted, accepted)

    def stage_acceptance(self, stages: int) -> str:
        """The share of drafts whose first i+1 tokens were all accepted, for each stage i."""
        if not self.accepted:
            return ""
        return " / ".join(f"{sum(a > i for a in self.accepted) / len(self.accepted):.0%}" for i in range(stages))


# heads drafting in the engine (kiln.runtime.heads_drafter.DraftSettings), beside the heads' fp32 chain alone
HEADS_SETTINGS = {
    "int8 2048 (engine chain)": {"vocab": 2048, "int8": True, "tree_nodes": 0, "alternatives": 0, "pause_below": 0.0},
    "int8 2048 (tree top-3, 8 nodes: the default)": {"vocab": 2048, "int8": True, "tree_nodes": 8, "pause_below": 0.0},
    "int8 2048 (tree top-3, 8 nodes, torch step)": {
        "vocab": 2048,
        "int8": True,
        "tree_nodes": 8,
        "pause_below": 0.0,
        "compiled": False,
    },
    "int8 2048 (engine chain, rests below 0.5 accepted)": {
        "vocab": 2048,
        "int8": True,
        "tree_nodes": 0,
        "alternatives": 0,
        "pause_below": 0.5,
    },
    "int8 2048 (tree top-3, 8 nodes, rests below 0.5 accepted)": {
        "vocab": 2048,
        "int8": True,
        "tree_nodes": 8,
        "pause_below": 0.5,
    },
}


# heads+lookup: the heads' tree (DraftSettings beside the default's) merged with prompt lookup's
# (PromptLookupDrafter's arguments) and, where the artifact stores them, the model's replies'
# (ReplyIndex settings beside the default's; None: without them)
LOOKUP_SETTINGS = {
    ": heads+lookup": ({}, {}, {}),
    ", without the stored replies": ({}, {}, None),
    ", the stored replies' top 2": ({}, {}, {"branches": 2}),
    ", lookup up to 12 tokens": ({}, {"max_draft": 12}, {}),
    ", heads' tree of 4 nodes": ({"tree_nodes": 4}, {}, {}),
    ", heads' chain": ({"tree_nodes": 0, "alternatives": 0}, {}, {}),
}


def fresh(speculative):
    """A drafter for one run: factories (heads keep per-generation state) are called."""
    return speculative() if callable(speculative) and not hasattr(speculative, "generate") else speculative


def heads_label(kind: str, entry: dict, artifact: str = "") -> str:
    """The heads' name in the table: eagle heads name what their layer attends over, and heads
    of two artifacts measured side by side (`artifact` given) the artifact's name."""
    context = f" ({entry.get('context', 'draft')} context)" if kind == "eagle" else ""
    return f"{kind} heads{context}" + (f" of {artifact}" if artifact else "")


def heads_notes(*sources: tuple[dict, set, str]) -> str:
    """What training made the artifacts' heads, from their manifests ((manifest, kinds measured,
    the artifact's name in the labels) each)."""
    lines = []
    speculators = [
        (kind, entry, artifact)
        for manifest, measured, artifact in sources
        for kind, entry in sorted(manifest.get("speculators", {}).items())
        if kind in measured
    ]
    for kind, entry, artifact in speculators:
        training = entry.get("training", {})
        config = training.get("config", {})
        lines.append(
            f"- {heads_label(kind, entry, artifact)}: {entry.get('stages')} stages, head {entry.get('head')}, "
            f"draft vocabulary {entry.get('draft_vocab')}, {training.get('steps')} steps (lr {config.get('lr')}, batch "
            f"{config.get('batch')}), {training.get('cpu_minutes')} CPU minutes; on held-out replies "
            f"top-1 accuracy per stage {training.get('stage_accuracy')} against the model's greedy "
            "choices"
            + (
                f", {training['accepted_per_draft']} tokens accepted per draft"
                if "accepted_per_draft" in training
                else ""
            )
        )
    return "\n\nThe heads (from the artifact's manifest):\n" + "\n".join(lines) if lines else ""


def stored_replies_note(manifest: dict) -> str:
    """What heads+lookup also drafts from: the replies stored beside the heads (runtime/reply_index.py)."""
    entry = manifest.get("speculator_replies")
    if not entry:
        return "\n\nThe target stores no replies: heads+lookup merges the heads and prompt lookup alone."
    return (
        f"\n\nheads+lookup also drafts from the model's {entry['replies']} replies stored beside the heads "
        f"({entry['tokens']} tokens, runtime/reply_index.py) unless the row says without them."
    )


def contention(other_cores: float) -> str:
    return f"{other_cores:.2f}{' *' if other_cores > CONTENDED_CORES else ''}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--draft-quantize", default="int4-g64")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", default=None, help="the heads' kinds measured, comma-separated (default: all)")
    parser.add_argument("--heads-from", default=None, help="another artifact whose eagle heads are measured too")
    parser.add_argument(
        "--methods",
        default=None,
        help="measure only the methods whose name contains one of these comma-separated words (plain always)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the artifact decoding (default: out/bench-spec-BACKEND.kiln, compiled if absent)",
    )
    parser.add_argument("--out", default="speculative.md", help="the results file's name in bench/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target_path = Path(args.target or f"out/bench-spec-{args.backend}.kiln")
    target = compiled(target_path, args.backend, None)
    drafts = {"prompt lookup (chain)": CHAIN_LOOKUP, "prompt lookup (tree)": "prompt_lookup"}
    try:
        self_draft = f"{args.draft_quantize} self-draft"
        if not args.methods or any(word in self_draft for word in args.methods.split(",")):
            drafts[self_draft] = compiled(
                Path(f"out/bench-spec-{args.backend}-{args.draft_quantize}.kiln"), args.backend, args.draft_quantize
            )
    except Exception as error:  # noqa: BLE001 - a scheme this backend cannot lower yet: report, keep going
        print(f"note: no {args.draft_quantize} draft on {args.backend}: {error}", file=sys.stderr)
    from kiln.runtime.artifact import read_manifest
    from kiln.runtime.drafters import StoredHeads
    from kiln.runtime.heads_drafter import DraftSettings
    from kiln.runtime.lookup_heads_drafter import MAX_NODES

    kinds = args.kinds.split(",") if args.kinds else None
    sources = [(None, target.manifest, target_path.name if args.heads_from else "")]
    if args.heads_from:  # two artifacts' heads: each labelled with its artifact's name
        other = read_manifest(Path(args.heads_from))
        sources.append((StoredHeads(Path(args.heads_from), other, target.graph), other, Path(args.heads_from).name))
    measured = {id(manifest): set() for _, manifest, _ in sources}
    for stored, manifest, artifact in sources:
        for kind, entry in sorted(manifest.get("speculators", {}).items()):
            if (kinds and kind not in kinds) or (stored is not None and kind != "eagle"):
                continue
            measured[id(manifest)].add(kind)
            label = heads_label(kind, entry, artifact)
            drafts[f"{label}, fp32 (chain)"] = functools.partial(TimedDrafter.heads, target, kind, stored)
            for name, settings in HEADS_SETTINGS.items():
                if kind == "eagle" or "tree" not in name:
                    drafts[f"{label}, {name}"] = functools.partial(EngineHeads, kind, DraftSettings(**settings), stored)
            for name, (settings, lookup, replies) in LOOKUP_SETTINGS.items():
                settings = DraftSettings(**{"pause_below": 0.0, **settings})
                drafts[f"{label} + prompt lookup, one tree ({MAX_NODES} nodes{name})"] = functools.partial(
                    EngineHeads, kind, settings, stored, lookup=lookup, replies=replies
                )
    if args.methods:
        words = args.methods.split(",")
        drafts = {method: draft for method, draft in drafts.items() if any(word in method for word in words)}
    lines = [
        "| prompt | method | tok/s | x plain | acceptance | tokens/target step | draft ms/step | "
        "accepted to stage 1/2/3/.. | same as plain | others' cores |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for name, text in (("code edit", CODE_PROMPT), ("prose", PROSE_PROMPT)):
        prompt = target.encode_chat([{"role": "user", "content": text}])
        run(target, prompt, 8, None)  # warm-up
        for speculative in drafts.values():
            run(target, prompt, 8, fresh(speculative))
        plain, seconds, others = run(target, prompt, args.tokens, None)
        plain_rate = len(plain.token_ids) / seconds
        lines.append(f"| {name} | plain greedy | {plain_rate:.1f} | 1.00 | | 1.00 | | | | {contention(others)} |")
        for method, speculative in drafts.items():
            drafter = fresh(speculative)
            result, seconds, others = run(target, prompt, args.tokens, drafter)
            same = "yes" if result.token_ids == plain.token_ids else "NO"
            rate = len(result.token_ids) / seconds
            drafter = drafter.drafter if isinstance(drafter, EngineHeads) else drafter
            timed = isinstance(drafter, TimedDrafter)
            draft_ms = (
                f"{drafter.seconds / result.stats.target_steps * 1000:.1f}"
                if timed and result.stats.target_steps
                else ""
            )
            stages = drafter.stage_acceptance(drafter.inner.heads.stages) if timed else ""
            lines.append(
                f"| {name} | {method} | {rate:.1f} | {rate / plain_rate:.2f} | "
                f"{result.stats.acceptance_rate:.0%} | {result.stats.tokens_per_target_step:.2f} | {draft_ms} | "
                f"{stages} | {same} | {contention(others)} |"
            )
    report = (
        "\n".join(lines)
        + (
            f"\n\n`*`: other processes kept more than {CONTENDED_CORES} of a core busy on "
            "average during the run (contended). `accepted to stage i`: the share of the heads' "
            "drafts whose first i tokens the target accepted."
        )
        + heads_notes(*((manifest, measured[id(manifest)], artifact) for _, manifest, artifact in sources))
        + stored_replies_note(target.manifest)
        + f"\n\nTarget: `{target_path}` ({target.manifest.get('options', {}).get('quantize') or 'f32'} weights)"
        + (f"; heads also from `{args.heads_from}`" if args.heads_from else "")
    )
    print(report)
    write_result(RESULTS / args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
