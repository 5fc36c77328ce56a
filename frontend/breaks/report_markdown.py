"""The graph-break report as Markdown: a summary, then per section a table of breaks by cost,
each break in detail (source with context, plain reason, ops around it, cost, remedy or fix),
and the recompiles with the guard that failed."""

from __future__ import annotations

import os

from .report_model import BreakEntry, RecompileEntry, Report, Section


def render_markdown(report: Report) -> str:
    """The whole report as one Markdown document."""
    counts = report.counts
    versions = ", ".join(f"{name} {version}" for name, version in report.versions.items())
    lines = [
        f"# Graph-break report: `{report.target}`",
        "",
        f"**{report.summary_line()}**, {counts['recompiles']} recompile(s). {versions}; {report.created}.",
        "",
    ]
    for section in report.sections:
        lines += _section(section)
    return "\n".join(lines).rstrip() + "\n"


def short_path(path: str) -> str:
    """A path as people read it: from the package root for installed code, else relative."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if not relative.startswith("..") else path


def _section(section: Section) -> list[str]:
    c = section.counts
    lines = [f"## {section.name}", "", section.description, ""]
    graphs = f"- Graphs Dynamo compiled: {section.graphs}"
    if section.graphs_after_remedies is not None:
        graphs += f"; after Kiln's remedies: {section.graphs_after_remedies}"
    lines += [
        graphs,
        f"- Breaks: {section.summary_line()}{kinds_note(section)}; single graph"
        f"{' after remedies' if section.graphs_after_remedies is not None else ''}: "
        f"{'yes' if section.single_graph else 'no'}",
        f"- Recompiles: {c['recompiles']}",
    ]
    if section.timing:
        t = section.timing
        share = t.outside_ms / t.total_ms if t.total_ms else 0.0
        lines.append(
            f"- Time per run (mean of {t.runs}): {t.total_ms:.2f} ms compiled, of which "
            f"{t.inside_ms:.2f} ms inside graphs and {t.outside_ms:.2f} ms ({share:.0%}) outside "
            f"({t.unattributed_ms:.2f} ms of it not after a break: Dynamo's guard checks, entering and "
            f"leaving frames); {t.eager_ms:.2f} ms without Dynamo"
        )
    lines += [f"- {note}" for note in section.notes] + [""]
    if section.breaks:
        lines += [
            "### Breaks, by cost",
            "",
            "| # | category | where | cost / run | share | Kiln |",
            "|---|---|---|---:|---:|---|",
        ]
        lines += [_break_row(b) for b in section.breaks] + [""]
        for entry in section.breaks:
            lines += _break_detail(entry)
    if section.recompiles:
        lines += ["### Recompiles", "", "| # | function | failed guard | value | times |", "|---|---|---|---|---:|"]
        lines += [
            f"| {r.id} | `{r.function}` | `{_cell(r.guard, 90)}` | {r.value} | {r.count} |" for r in section.recompiles
        ]
        lines.append("")
        for entry in section.recompiles:
            lines += _recompile_detail(entry)
    return lines


def kinds_note(section: Section) -> str:
    """ " (5 kinds, met 12 times)": Dynamo's break types among the breaks, and how often it met them."""
    if not section.breaks:
        return ""
    kinds = len({b.gb_type for b in section.breaks})
    return f" ({kinds} kind{'s' if kinds > 1 else ''}, met {sum(b.occurrences for b in section.breaks)} times)"


def _break_row(b: BreakEntry) -> str:
    where = f"`{short_path(b.location.file)}:{b.location.line}` in `{b.location.function}`"
    cost = f"{b.cost_ms:.3f} ms" if b.cost_ms is not None else "-"
    share = f"{b.cost_share:.1%}" if b.cost_share is not None else "-"
    kiln = f"eliminated ({b.remedy})" if b.eliminated else "left"
    return f"| {b.id} | {b.category_title} | {where} | {cost} | {share} | {kiln} |"


def _break_detail(b: BreakEntry) -> list[str]:
    lines = [
        f"#### {b.id} · {b.category_title} · `{short_path(b.location.file)}:{b.location.line}` in "
        f"`{b.location.function}`",
        "",
        "```python",
    ]
    width = len(str(b.location.context[-1].line)) if b.location.context else 1
    for source in b.location.context:
        mark = ">" if source.line == b.location.line else " "
        lines.append(f"{mark} {source.line:>{width}} | {source.text}")
    lines += [
        "```",
        "",
        f"- **Why:** {b.reason}",
        f"- **Dynamo says:** `{_cell(b.dynamo_reason, 200)}` (`{b.gb_type}`)"
        + (f", {b.doc_link}" if b.doc_link else ""),
        f"- **Ops around it:** before: {_ops(b.ops_before)}; after: {_ops(b.ops_after)}",
    ]
    if b.cost_ms is not None:
        lines.append(
            f"- **Cost:** {b.cost_ms:.3f} ms per run outside graphs ({b.cost_share or 0:.1%} of the run); "
            f"met {b.occurrences} time(s)" + ("; Dynamo ran the whole function in Python" if b.skipped_frame else "")
        )
    if b.eliminated:
        lines.append(f"- **Kiln:** eliminated ({b.remedy}): {b.remedy_how}")
    else:
        lines.append(f"- **Kiln:** not eliminated. **Fix:** {b.fix}")
    if len(b.stack) > 1:
        lines.append("- **Stack:** " + " → ".join(f"`{_short_frame(f)}`" for f in b.stack))
    return lines + [""]


def _recompile_detail(r: RecompileEntry) -> list[str]:
    lines = [
        f"#### {r.id} · `{r.function}` (`{short_path(r.file)}:{r.line}`) recompiled {r.count} time(s)",
        "",
        f"- **Guard:** `{_cell(r.guard, 300)}`",
        f"- **Why:** {r.reason}",
    ]
    if r.kiln:
        lines.append(f"- **Kiln:** {r.kiln}")
    lines.append(f"- **Fix:** {r.fix}")
    return lines + [""]


def _ops(ops) -> str:
    if ops.fragment is None:
        return "no graph"
    top = ", ".join(f"{name} ×{n}" for name, n in ops.top.items())
    return f"graph F{ops.fragment}, {ops.count} ops ({top})" if top else f"graph F{ops.fragment}, no ops"


def _short_frame(frame: str) -> str:
    path, _, rest = frame.partition(":")
    return f"{short_path(path)}:{rest}"


def _cell(text: str, limit: int) -> str:
    flat = " ".join(text.split()).replace("|", "\\|").replace("`", "'")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
