"""The graph-break check every compile runs: the stateless forward Kiln compiles, captured once
with Dynamo (no `generate`, no decode steps: seconds, not minutes), its breaks explained and
removed where Kiln can. A break that stays fails the compile with the report; the report goes
into the artifact as `report.md` and `report.json`. `compile-model explain` goes deeper.
"""

from __future__ import annotations

import json

import torch

from ..errors import KilnError
from .analysis import analyze
from .report_markdown import render_markdown, short_path
from .report_model import Report, make_report
from .targets import stateless_forward_subject

REPORT_FILES = ("report.md", "report.json")
COST_RUNS = 1  # the forward is timed once (after a warm-up): a compile should not wait on timing


class GraphBreakError(KilnError):
    """The model's forward still has graph breaks after Kiln's remedies.

    Attributes:
        report: the full graph-break report (render it with `render_markdown`).
    """

    def __init__(self, report: Report) -> None:
        self.report = report
        left = [b for s in report.sections for b in s.breaks if not b.eliminated]
        details = "; ".join(
            f"{b.id} ({b.category_title}) at {short_path(b.location.file)}:{b.location.line}: {b.reason} Fix: {b.fix}"
            for b in left
        )
        super().__init__(
            f"The forward of {report.target} has graph breaks Kiln cannot remove "
            f"({report.summary_line()}): {details} Run `compile-model explain {report.target}` "
            "for the full report."
        )


def check_graph_breaks(lm: torch.nn.Module, target: str) -> Report:
    """Capture `lm`'s stateless forward with Dynamo and explain it; raise GraphBreakError if a
    break is left. Branch rewrites Kiln applied stay on `lm`, so the capture that follows sees them."""
    section = analyze(stateless_forward_subject(lm), runs=COST_RUNS)
    report = make_report(target, [section])
    if not section.single_graph:
        raise GraphBreakError(report)
    return report


def report_files(report: Report) -> dict[str, str]:
    """The report as artifact files: {name: text}."""
    return {"report.md": render_markdown(report), "report.json": json.dumps(report.to_json(), indent=2) + "\n"}
