"""The graph-break report as one self-contained HTML file: inline CSS, no script, no external
resource, readable from disk. Each section draws its fragments graph as inline SVG: the graphs
Dynamo compiled (boxes, with their op counts) and the breaks between them (circles: red when
left, green when Kiln eliminated them), in the order Dynamo met them."""

from __future__ import annotations

from html import escape

from .report_markdown import kinds_note, short_path
from .report_model import BreakEntry, RecompileEntry, Report, Section

NODES_PER_ROW = 8
DX, DY, MARGIN = 120, 100, 40
BOX_W, BOX_H, RADIUS = 84, 40, 20

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1d1d1f;padding:0 1em}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;width:100%;margin:.5em 0}
th,td{border:1px solid #ddd;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f4f4f6}td.num{text-align:right;white-space:nowrap}
code,pre{font-family:ui-monospace,monospace;font-size:12.5px}
pre{background:#f6f8fa;padding:8px;overflow-x:auto}.hit{background:#fff3c4;display:block}
.left{color:#b3261e;font-weight:600}.gone{color:#1b7f3b;font-weight:600}.summary{font-size:1.1em}
details{border:1px solid #e2e2e6;border-radius:6px;padding:.4em .8em;margin:.5em 0}
summary{cursor:pointer;font-weight:600}
dl{display:grid;grid-template-columns:9em 1fr;gap:.3em 1em}dt{font-weight:600;color:#555}dd{margin:0}
figure{margin:1em 0;overflow-x:auto}figcaption{color:#555;font-size:.9em}
"""


def render_html(report: Report) -> str:
    """The whole report as one HTML document."""
    counts = report.counts
    versions = ", ".join(f"{escape(n)} {escape(v)}" for n, v in report.versions.items())
    body = [
        f"<h1>Graph-break report: <code>{escape(report.target)}</code></h1>",
        f"<p class='summary'><strong>{escape(report.summary_line())}</strong>, "
        f"{counts['recompiles']} recompile(s).</p><p>{versions}; {escape(report.created)}.</p>",
    ]
    body += [_section(i, s) for i, s in enumerate(report.sections)]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>Graph-break report: {escape(report.target)}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


def _section(number: int, section: Section) -> str:
    items = [
        f"Graphs Dynamo compiled: {section.graphs}"
        + (
            f"; after Kiln's remedies: {section.graphs_after_remedies}"
            if section.graphs_after_remedies is not None
            else ""
        ),
        f"Breaks: {section.summary_line()}{kinds_note(section)}; "
        f"single graph: {'yes' if section.single_graph else 'no'}",
        f"Recompiles: {section.counts['recompiles']}",
    ]
    if section.timing:
        t = section.timing
        items.append(
            f"Time per run (mean of {t.runs}): {t.total_ms:.2f} ms compiled, {t.inside_ms:.2f} ms inside "
            f"graphs, {t.outside_ms:.2f} ms outside ({t.unattributed_ms:.2f} ms not after a break: guard "
            f"checks, entering and leaving frames); {t.eager_ms:.2f} ms without Dynamo"
        )
    parts = [f"<section id='s{number}'><h2>{escape(section.name)}</h2><p>{_code(section.description)}</p><ul>"]
    parts += [f"<li>{escape(item)}</li>" for item in items]
    parts += [f"<li>{_code(note)}</li>" for note in section.notes] + ["</ul>"]
    parts.append(
        f"<figure>{fragments_svg(section, f's{number}-')}<figcaption>Fragments graph: the graphs Dynamo compiled "
        "(boxes) and the breaks between them (circles; red: left, green: eliminated).</figcaption></figure>"
    )
    if section.breaks:
        parts.append(
            "<h3>Breaks, by cost</h3><table><tr><th>#</th><th>category</th><th>where</th>"
            "<th>cost / run</th><th>share</th><th>Kiln</th></tr>"
        )
        parts += [_break_row(number, b) for b in section.breaks] + ["</table>"]
        parts += [_break_detail(number, b) for b in section.breaks]
    if section.recompiles:
        parts.append("<h3>Recompiles</h3>")
        parts += [_recompile_detail(r) for r in section.recompiles]
    return "".join(parts) + "</section>"


def _break_row(number: int, b: BreakEntry) -> str:
    cost = f"{b.cost_ms:.3f} ms" if b.cost_ms is not None else "-"
    share = f"{b.cost_share:.1%}" if b.cost_share is not None else "-"
    kiln = (
        f"<span class='gone'>eliminated</span> ({escape(b.remedy)})"
        if b.eliminated
        else "<span class='left'>left</span>"
    )
    return (
        f"<tr><td><a href='#s{number}-{b.id}'>{b.id}</a></td><td>{escape(b.category_title)}</td>"
        f"<td><code>{escape(short_path(b.location.file))}:{b.location.line}</code> in "
        f"<code>{escape(b.location.function)}</code></td><td class='num'>{cost}</td>"
        f"<td class='num'>{share}</td><td>{kiln}</td></tr>"
    )


def _break_detail(number: int, b: BreakEntry) -> str:
    source = "".join(
        f"<span class='hit'>{line.line:>5} | {escape(line.text)}</span>"
        if line.line == b.location.line
        else f"{line.line:>5} | {escape(line.text)}\n"
        for line in b.location.context
    )
    kiln = (
        f"<span class='gone'>eliminated</span> ({escape(b.remedy)}): {_code(b.remedy_how or '')}"
        if b.eliminated
        else "<span class='left'>not eliminated</span>"
    )
    rows = [
        ("Why", _code(b.reason)),
        ("Dynamo says", f"<code>{escape(b.dynamo_reason[:300])}</code> (<code>{escape(b.gb_type)}</code>)"),
        ("Ops before", escape(_ops(b.ops_before))),
        ("Ops after", escape(_ops(b.ops_after))),
        (
            "Cost",
            escape(f"{b.cost_ms:.3f} ms per run ({b.cost_share or 0:.1%}), met {b.occurrences} time(s)")
            if b.cost_ms is not None
            else "not measured",
        ),
        ("Kiln", kiln),
        ("Fix", _code(b.fix)),
        ("Stack", "<br>".join(f"<code>{escape(f)}</code>" for f in b.stack)),
    ]
    if b.doc_link:
        rows.append(("PyTorch docs", escape(b.doc_link)))
    table = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    return (
        f"<details id='s{number}-{b.id}' open><summary>{b.id} · {escape(b.category_title)} · "
        f"{escape(short_path(b.location.file))}:{b.location.line} in {escape(b.location.function)}</summary>"
        f"<pre><code>{source}</code></pre><dl>{table}</dl></details>"
    )


def _recompile_detail(r: RecompileEntry) -> str:
    rows = [("Guard", f"<code>{escape(r.guard[:400])}</code>"), ("Value", escape(r.value)), ("Why", _code(r.reason))]
    if r.kiln:
        rows.append(("Kiln", _code(r.kiln)))
    rows.append(("Fix", _code(r.fix)))
    table = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    return (
        f"<details open><summary>{r.id} · {escape(r.function)} ({escape(short_path(r.file))}:{r.line}) "
        f"recompiled {r.count} time(s)</summary><dl>{table}</dl></details>"
    )


def _ops(ops) -> str:
    if ops.fragment is None:
        return "no graph"
    top = ", ".join(f"{name} ×{n}" for name, n in ops.top.items())
    return f"graph F{ops.fragment}: {ops.count} ops" + (f" ({top})" if top else "")


def _code(text: str) -> str:
    """Escape text, turning `backticks` into <code>."""
    pieces = escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


# -- the fragments graph ------------------------------------------------------------------------
def fragments_svg(section: Section, anchor_prefix: str = "") -> str:
    """Inline SVG: fragments and breaks in the order met, wrapped into rows, edges as arrows;
    each break links to `#{anchor_prefix}{id}`."""
    order = _node_order(section)
    if not order:
        return (
            "<svg xmlns='http://www.w3.org/2000/svg' width='300' height='40'><text x='10' y='25'>no graph</text></svg>"
        )
    position = {
        node: (MARGIN + BOX_W / 2 + (i % NODES_PER_ROW) * DX, MARGIN + BOX_H / 2 + (i // NODES_PER_ROW) * DY)
        for i, node in enumerate(order)
    }
    rows = (len(order) - 1) // NODES_PER_ROW + 1
    width = 2 * MARGIN + BOX_W + (min(len(order), NODES_PER_ROW) - 1) * DX
    height = 2 * MARGIN + BOX_H + (rows - 1) * DY
    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='fragments graph of {escape(section.name)}'>",
        "<defs><marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
        "orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#666'/></marker></defs>",
    ]
    half = {node: (BOX_W / 2 if node.startswith("F") else RADIUS) for node in order}
    parts += [
        _edge(position[a], position[b], half[a], half[b]) for a, b in section.edges if a in position and b in position
    ]
    fragments = {f"F{f.index}": f for f in section.fragments}
    breaks = {b.id: b for b in section.breaks}
    for node in order:
        x, y = position[node]
        parts.append(
            _fragment_node(x, y, fragments[node])
            if node in fragments
            else _break_node(x, y, breaks[node], anchor_prefix)
        )
    return "".join(parts) + "</svg>"


def _node_order(section: Section) -> list[str]:
    """Fragments by index, each followed by the breaks that leave it; breaks before any graph first."""
    leaving: dict[str, list[str]] = {}
    placed = set()
    for a, b in section.edges:
        if a.startswith("F") and b.startswith("B"):
            leaving.setdefault(a, []).append(b)
            placed.add(b)
    order = [b.id for b in section.breaks if b.id not in placed]
    for fragment in section.fragments:
        node = f"F{fragment.index}"
        order.append(node)
        order += [b for b in leaving.get(node, []) if b not in order]
    return order


def _edge(start: tuple[float, float], end: tuple[float, float], start_half: float, end_half: float) -> str:
    """An arrow between two shapes: straight along a row, an arc otherwise (over the row when it
    goes back, so it does not cross the shapes between)."""
    (x1, y1), (x2, y2) = start, end
    if abs(y1 - y2) < 1 and 0 < x2 - x1 <= DX + 1:  # neighbours on a row
        return (
            f"<line x1='{x1 + start_half:.0f}' y1='{y1:.0f}' x2='{x2 - end_half:.0f}' y2='{y2:.0f}' "
            "stroke='#666' stroke-width='1.5' marker-end='url(#arrow)'/>"
        )
    if abs(y1 - y2) < 1:  # same row, further away or backwards: arc above the row
        top = y1 - BOX_H / 2 - min(15 + 6 * abs(x2 - x1) / DX, MARGIN - 4)  # stays inside the margin
        return (
            f"<path d='M{x1:.0f},{y1 - BOX_H / 2:.0f} C{x1:.0f},{top:.0f} {x2:.0f},{top:.0f} "
            f"{x2:.0f},{y2 - BOX_H / 2:.0f}' fill='none' stroke='#666' stroke-width='1.5' marker-end='url(#arrow)'/>"
        )
    return (
        f"<path d='M{x1:.0f},{y1 + BOX_H / 2:.0f} C{x1:.0f},{y1 + DY / 2:.0f} {x2:.0f},{y2 - DY / 2:.0f} "
        f"{x2:.0f},{y2 - BOX_H / 2:.0f}' fill='none' stroke='#666' stroke-width='1.5' marker-end='url(#arrow)'/>"
    )


def _fragment_node(x: float, y: float, fragment) -> str:
    tip = f"graph F{fragment.index}: {fragment.op_count} ops, ended by {fragment.ended_by}"
    return (
        f"<g><title>{escape(tip)}</title><rect x='{x - BOX_W / 2:.0f}' y='{y - BOX_H / 2:.0f}' width='{BOX_W}' "
        f"height='{BOX_H}' rx='6' fill='#e8eefc' stroke='#3d5a99'/>"
        f"<text x='{x:.0f}' y='{y - 3:.0f}' text-anchor='middle' font-size='13' font-weight='600'>"
        f"F{fragment.index}</text>"
        f"<text x='{x:.0f}' y='{y + 13:.0f}' text-anchor='middle' font-size='11'>{fragment.op_count} ops</text></g>"
    )


def _break_node(x: float, y: float, entry: BreakEntry, anchor_prefix: str) -> str:
    color, stroke = ("#d9f2e0", "#1b7f3b") if entry.eliminated else ("#fbe0de", "#b3261e")
    tip = f"{entry.id}: {entry.category_title} at {short_path(entry.location.file)}:{entry.location.line}"
    return (
        f"<a href='#{escape(anchor_prefix + entry.id)}'><g><title>{escape(tip)}</title>"
        f"<circle cx='{x:.0f}' cy='{y:.0f}' "
        f"r='{RADIUS}' fill='{color}' stroke='{stroke}' stroke-width='2'/><text x='{x:.0f}' y='{y + 4:.0f}' "
        f"text-anchor='middle' font-size='12' font-weight='600'>{escape(entry.id)}</text></g></a>"
    )
