"""Explain a piece of code to Dynamo's face: capture it as written, measure what its breaks cost,
apply Kiln's remedies, capture again, and build the report section.

A `Subject` is one thing to capture: the function Dynamo compiles, a workload that drives it
(one call, or a prefill and decode steps), and what the remedies may use (the module whose
methods may be rewritten, a stateless variant without Python cache objects). A remedy counts
only if the remedied capture has no break at that place and gives the same output as the code
as written, run without Dynamo.
"""

from __future__ import annotations

import linecache
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from .categories import CATEGORIES, Diagnosis, diagnose, parse_message
from .cost import CostMeasurement, break_costs, measure_cost
from .guard_failures import diagnose_guard
from .recording import DynamoCapture, FoundBreak, Workload, capture_with_dynamo, distinct_breaks
from .remedies import REMEDIES, dynamo_config, rewrite_branches
from .report_model import (
    FOLLOW_ON,
    BreakEntry,
    FragmentEntry,
    Location,
    OpsSummary,
    RecompileEntry,
    Section,
    SourceLine,
    Timing,
)

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
OUTPUT_TOLERANCE = 1e-4  # fp32: remedies reorder nothing numerically, stateless attention may round differently
CONTEXT_LINES = 2


@dataclass
class Subject:
    """One thing to capture and explain."""

    name: str
    description: str
    fn: Callable
    run: Workload  # drives `fn`, returns the outputs to compare (tensors)
    module: torch.nn.Module | None = None  # whose methods `branch_to_select` may rewrite
    stateless: Subject | None = None  # the same computation without a Python cache object
    compiled_by_kiln: bool = True  # False: explained only, no remedies (Kiln's runtime replaces it)
    notes: list[str] = field(default_factory=list)


@dataclass
class RemedyOutcome:
    remedies: list[str | None]  # per found break: the remedy that removed it, or None
    graphs_after: int | None = None
    breaks_after: int | None = None
    notes: list[str] = field(default_factory=list)


def analyze(subject: Subject, measure: bool = True, runs: int = 3) -> Section:
    """Capture `subject` with Dynamo, explain every break and recompile, remove what Kiln can."""
    try:
        with torch.no_grad():
            before = capture_with_dynamo(subject.fn, subject.run)
            found = distinct_breaks(before)
            diagnoses = [diagnose(b.gb_type, b.message, b.stack) for b in found]
            cost = measure_cost(before, subject.run, subject.fn, runs) if measure else None
            outcome = RemedyOutcome([None] * len(found))
            if subject.compiled_by_kiln and found:
                outcome = apply_remedies(subject, found, diagnoses)
        return build_section(subject, before, found, diagnoses, cost, outcome)
    finally:
        torch._dynamo.reset()  # drop the compiled code and its hooks into the model


def apply_remedies(subject: Subject, found: list[FoundBreak], diagnoses: list[Diagnosis]) -> RemedyOutcome:
    """Apply every remedy the diagnoses call for, capture again, and keep the remedies only if
    the output is unchanged. Branch rewrites stay on the module when kept."""
    wanted = {d.remedy for d in diagnoses if d.remedy}
    if not wanted:
        return RemedyOutcome(
            [None] * len(found),
            notes=["Kiln has no automatic remedy for these breaks; each one says how to fix it in the code."],
        )
    target = subject.stateless if "stateless_capture" in wanted and subject.stateless else subject
    applied = wanted - ({"stateless_capture"} if target is subject else set()) - {"branch_to_select"}
    expected = subject.run(subject.fn)  # before any rewrite: the code as written, without Dynamo
    branches = [b.where for b, d in zip(found, diagnoses) if d.remedy == "branch_to_select" and b.where]
    rewrites = rewrite_branches(target.module, branches) if branches and target.module is not None else {}
    if rewrites:
        applied.add("branch_to_select")
    try:
        after = capture_with_dynamo(target.fn, target.run, dynamo_config(applied))
        difference = max_difference(expected, after.outputs)
    except Exception as error:  # noqa: BLE001 (a remedy that fails leaves the code as written)
        _undo(rewrites)
        return RemedyOutcome(
            [None] * len(found),
            notes=[f"Kiln's remedies failed ({type(error).__name__}: {str(error).splitlines()[0]}); none was kept."],
        )
    if difference is None or difference > OUTPUT_TOLERANCE:
        _undo(rewrites)
        return RemedyOutcome(
            [None] * len(found),
            notes=[f"Kiln's remedies changed the output (max abs difference {difference}); none was kept."],
        )
    left = distinct_breaks(after)
    left_places = {_place(b) for b in left}
    remedies = [
        None if _place(b) in left_places else (d.remedy if d.remedy in applied else FOLLOW_ON)
        for b, d in zip(found, diagnoses)
    ]
    note = (
        f"After Kiln's remedies ({', '.join(sorted(applied)) or 'none'}), Dynamo captured "
        f"{len(after.fragments)} graph(s) with {len(left)} break(s) left; the output is unchanged "
        f"(max abs difference {difference:.1e} against the code as written, run eagerly)."
    )
    return RemedyOutcome(remedies, len(after.fragments), len(left), [note])


def max_difference(expected, actual) -> float | None:
    """Largest absolute difference between two outputs of the same structure; None if they differ."""
    a, b = tree_leaves(expected), tree_leaves(actual)
    if len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape:
                return None
            if x.numel():
                worst = max(worst, (x.double() - y.double()).abs().max().item())
        elif x != y:
            return None
    return worst


def _undo(rewrites: dict) -> None:
    for rewrite in rewrites.values():
        rewrite.undo()


def _place(found: FoundBreak) -> tuple[str, int]:
    where = found.where
    return (where.filename, where.lineno) if where else ("", 0)


# -- the report section -------------------------------------------------------------------------
def build_section(
    subject: Subject,
    capture: DynamoCapture,
    found: list[FoundBreak],
    diagnoses: list[Diagnosis],
    cost: CostMeasurement | None,
    outcome: RemedyOutcome,
) -> Section:
    """The report section for one analysed subject; breaks ordered by measured cost."""
    costs = break_costs(found, cost) if cost else {}
    total = cost.total_s if cost else 0.0
    order = sorted(range(len(found)), key=lambda i: (-costs.get(i, 0.0), i))
    ids = {position: f"B{rank + 1}" for rank, position in enumerate(order)}
    breaks = [
        _break_entry(ids[i], found[i], diagnoses[i], capture, costs.get(i), total, outcome.remedies[i]) for i in order
    ]
    left = sum(1 for b in breaks if not b.eliminated)
    notes = list(subject.notes) + outcome.notes
    if not found:
        notes.insert(
            0,
            f"Dynamo captured this as one graph: no graph break "
            f"({len(capture.fragments)} graph(s) compiled, counting recompiles).",
        )
    return Section(
        name=subject.name,
        description=subject.description,
        compiled_by_kiln=subject.compiled_by_kiln,
        graphs=len(capture.fragments),
        graphs_after_remedies=outcome.graphs_after,
        single_graph=left == 0,
        breaks=breaks,
        recompiles=_recompile_entries(capture),
        fragments=_fragment_entries(capture, found, ids),
        edges=_edges(found, ids),
        timing=Timing(
            cost.runs,
            cost.total_s * 1e3,
            cost.inside_s * 1e3,
            cost.outside_s * 1e3,
            max(cost.outside_s - sum(costs.values()), 0.0) * 1e3,
            cost.eager_s * 1e3,
        )
        if cost
        else None,
        notes=notes,
    )


def _break_entry(
    break_id: str,
    found: FoundBreak,
    diagnosis: Diagnosis,
    capture: DynamoCapture,
    seconds: float | None,
    total: float,
    remedy: str | None,
) -> BreakEntry:
    parsed = parse_message(found.message, found.gb_type)
    where = found.where
    how = None
    if remedy == FOLLOW_ON:
        how = "it disappeared once the break before it was removed."
    elif remedy is not None:
        how = REMEDIES[remedy].how
    return BreakEntry(
        id=break_id,
        category=diagnosis.category,
        category_title=CATEGORIES[diagnosis.category].title,
        gb_type=found.gb_type,
        dynamo_reason=found.graph_reason or parsed.explanation or found.gb_type,
        reason=diagnosis.plain,
        location=_location(where),
        stack=[str(f) for f in found.stack if not f.filename.startswith(TORCH_DIR)],  # not Dynamo's wrappers
        occurrences=found.occurrences,
        skipped_frame=found.skipped_frame,
        ops_before=_ops(capture, found.fragment_before),
        ops_after=_ops(capture, found.fragment_after),
        cost_ms=None if seconds is None else seconds * 1e3,
        cost_share=None if seconds is None or not total else seconds / total,
        eliminated=remedy is not None,
        remedy=remedy,
        remedy_how=how,
        fix=diagnosis.fix,
        doc_link=parsed.link,
    )


def _location(where) -> Location:
    if where is None:
        return Location("<unknown>", 0, "<unknown>")
    lines = range(max(where.lineno - CONTEXT_LINES, 1), where.lineno + CONTEXT_LINES + 1)
    context = [SourceLine(n, linecache.getline(where.filename, n).rstrip("\n")) for n in lines]
    return Location(
        where.filename, where.lineno, where.function, [c for c in context if c.text or c.line <= where.lineno]
    )


def _ops(capture: DynamoCapture, index: int | None) -> OpsSummary:
    if index is None:
        return OpsSummary(None, 0, {})
    ops = capture.fragments[index].ops
    return OpsSummary(index, len(ops), dict(Counter(ops).most_common(5)))


def _recompile_entries(capture: DynamoCapture) -> list[RecompileEntry]:
    grouped: dict[tuple, RecompileEntry] = {}
    for event in capture.recompiles:
        diagnosis = diagnose_guard(event.guards[0] if event.guards else "")
        key = (event.function, event.filename, diagnosis.category, diagnosis.source)
        if key in grouped:
            grouped[key].count += 1
            continue
        grouped[key] = RecompileEntry(
            id=f"R{len(grouped) + 1}",
            function=event.function,
            file=event.filename,
            line=event.lineno,
            guard=diagnosis.guard,
            source=diagnosis.source,
            value=diagnosis.value,
            category=diagnosis.category,
            reason=diagnosis.plain,
            fix=diagnosis.fix,
            kiln=diagnosis.kiln,
            count=1,
        )
    return list(grouped.values())


def _fragment_entries(capture: DynamoCapture, found: list[FoundBreak], ids: dict[int, str]) -> list[FragmentEntry]:
    ended_by = {graph: ids[i] for i, b in enumerate(found) for graph in b.ended_graphs}
    return [
        FragmentEntry(
            f.index,
            len(f.ops),
            dict(Counter(f.ops).most_common(5)),
            ended_by.get(f.index, f.reason.splitlines()[0] if f.reason else ""),
        )
        for f in capture.fragments
    ]


def _edges(found: list[FoundBreak], ids: dict[int, str]) -> list[tuple[str, str]]:
    """The fragments graph: each break between the graphs that ran into it and after it."""
    edges = []
    for i, b in enumerate(found):
        edges += [(f"F{g}", ids[i]) for g in b.graphs_in] + [(ids[i], f"F{g}") for g in b.graphs_out]
    return edges
