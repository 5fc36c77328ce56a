"""The graph-break report as data: what the Markdown, HTML and JSON forms all say.

A `Report` has one `Section` per thing captured (a model's forward with its cache, the
stateless forward Kiln compiles, `model.generate`, a user's module). `Report.to_json()` gives
the JSON form, checked by `REPORT_SCHEMA` (a JSON Schema, written out as
`docs/report-schema.json` and described in `docs/report-schema.md`).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field

from .categories import CATEGORIES
from .remedies import REMEDIES

SCHEMA_VERSION = 1
FOLLOW_ON = "follow_on"  # a break that disappeared with the remedy of the break that caused it


@dataclass
class SourceLine:
    line: int
    text: str


@dataclass
class Location:
    file: str
    line: int
    function: str
    context: list[SourceLine] = field(default_factory=list)  # a few lines around `line`


@dataclass
class OpsSummary:
    """The ops of the graph on one side of a break (fragment None: no graph there)."""

    fragment: int | None
    count: int
    top: dict[str, int]  # the most frequent ops, most frequent first


@dataclass
class BreakEntry:
    id: str  # "B1", "B2", ... ordered by cost
    category: str  # a key of categories.CATEGORIES
    category_title: str
    gb_type: str  # Dynamo's name for it
    dynamo_reason: str  # Dynamo's words: the graph's compile reason or its explanation
    reason: str  # the reason in plain words
    location: Location
    stack: list[str]  # "file:line in function", outermost first
    occurrences: int  # how often Dynamo met it (each compile and recompile that reached it)
    skipped_frame: bool  # Dynamo ran the whole function in Python because of it
    ops_before: OpsSummary
    ops_after: OpsSummary
    cost_ms: float | None  # measured time outside graphs per run, attributed to this break
    cost_share: float | None  # cost_ms / the run's total time
    eliminated: bool
    remedy: str | None  # the Kiln remedy that removed it
    remedy_how: str | None
    fix: str  # a concrete code fix (what to change when Kiln did not remove it)
    doc_link: str = ""


@dataclass
class RecompileEntry:
    id: str  # "R1", ...
    function: str
    file: str
    line: int
    guard: str  # the failed guard
    source: str  # the input it checks
    value: str  # the value that failed it ("dim 2: 7 -> 8")
    category: str
    reason: str
    fix: str
    kiln: str | None  # how Kiln's capture avoids it
    count: int


@dataclass
class FragmentEntry:
    index: int
    op_count: int
    top_ops: dict[str, int]
    ended_by: str  # a break id, or Dynamo's reason ("return_value")


@dataclass
class Timing:
    runs: int
    total_ms: float  # one run of the workload, compiled (graphs run eagerly)
    inside_ms: float  # of which inside graphs
    outside_ms: float
    unattributed_ms: float  # outside graphs but not after a break: guard checks, entering/leaving frames
    eager_ms: float  # the same workload without Dynamo


@dataclass
class Section:
    name: str
    description: str  # what was run
    compiled_by_kiln: bool  # False: explained only (Kiln's runtime replaces this code)
    graphs: int  # graphs Dynamo compiled as written (recompiles included)
    graphs_after_remedies: int | None  # None when no remedy was needed or tried
    single_graph: bool  # one graph (per specialization) after Kiln's remedies
    breaks: list[BreakEntry]
    recompiles: list[RecompileEntry]
    fragments: list[FragmentEntry]
    edges: list[tuple[str, str]]  # the fragments graph: "F0" -> "B1" -> "F1" ...
    timing: Timing | None
    notes: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        eliminated = sum(b.eliminated for b in self.breaks)
        return {
            "breaks_found": len(self.breaks),
            "eliminated": eliminated,
            "left": len(self.breaks) - eliminated,
            "recompiles": sum(r.count for r in self.recompiles),
        }

    def summary_line(self) -> str:
        return summary_line(self.counts)


def summary_line(counts: dict[str, int]) -> str:
    """ "3 breaks found, 3 eliminated, 0 left"."""
    found = counts["breaks_found"]
    return f"{found} break{'' if found == 1 else 's'} found, {counts['eliminated']} eliminated, {counts['left']} left"


@dataclass
class Report:
    target: str
    sections: list[Section]
    versions: dict[str, str]  # kiln, torch, transformers
    created: str  # ISO 8601

    @property
    def counts(self) -> dict[str, int]:
        totals = {"breaks_found": 0, "eliminated": 0, "left": 0, "recompiles": 0}
        for section in self.sections:
            for key, value in section.counts.items():
                totals[key] += value
        return totals

    def summary_line(self) -> str:
        return summary_line(self.counts)

    def to_json(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "target": self.target,
            "created": self.created,
            "versions": dict(self.versions),
            "summary": self.counts,
            "sections": [_section_json(s) for s in self.sections],
        }


def _section_json(section: Section) -> dict:
    data = dataclasses.asdict(section)
    data["edges"] = [list(edge) for edge in section.edges]
    data["summary"] = section.counts
    return data


# -- the JSON Schema ----------------------------------------------------------------------------
def _obj(properties: dict, optional: tuple = ()) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": [k for k in properties if k not in optional],
    }


_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_STR_OR_NULL = {"type": ["string", "null"]}
_COUNTS = {"type": "object", "additionalProperties": {"type": "integer"}}
_SUMMARY = _obj({"breaks_found": _INT, "eliminated": _INT, "left": _INT, "recompiles": _INT})
_OPS = _obj({"fragment": {"type": ["integer", "null"]}, "count": _INT, "top": _COUNTS})
_LOCATION = _obj(
    {
        "file": _STR,
        "line": _INT,
        "function": _STR,
        "context": {"type": "array", "items": _obj({"line": _INT, "text": _STR})},
    }
)
_CATEGORY_KEYS = list(CATEGORIES)
_BREAK = _obj(
    {
        "id": {"type": "string", "pattern": "^B[0-9]+$"},
        "category": {"enum": _CATEGORY_KEYS},
        "category_title": _STR,
        "gb_type": _STR,
        "dynamo_reason": _STR,
        "reason": _STR,
        "location": _LOCATION,
        "stack": {"type": "array", "items": _STR},
        "occurrences": _INT,
        "skipped_frame": _BOOL,
        "ops_before": _OPS,
        "ops_after": _OPS,
        "cost_ms": _NUM_OR_NULL,
        "cost_share": _NUM_OR_NULL,
        "eliminated": _BOOL,
        "remedy": {"enum": [None, *REMEDIES, FOLLOW_ON]},
        "remedy_how": _STR_OR_NULL,
        "fix": _STR,
        "doc_link": _STR,
    }
)
_RECOMPILE = _obj(
    {
        "id": {"type": "string", "pattern": "^R[0-9]+$"},
        "function": _STR,
        "file": _STR,
        "line": _INT,
        "guard": _STR,
        "source": _STR,
        "value": _STR,
        "category": {"enum": ["dynamic_shape", "value_specialization", "object_identity", "tensor_property", "other"]},
        "reason": _STR,
        "fix": _STR,
        "kiln": _STR_OR_NULL,
        "count": _INT,
    }
)
_FRAGMENT = _obj({"index": _INT, "op_count": _INT, "top_ops": _COUNTS, "ended_by": _STR})
_TIMING = _obj(
    {
        "runs": _INT,
        "total_ms": {"type": "number"},
        "inside_ms": {"type": "number"},
        "outside_ms": {"type": "number"},
        "unattributed_ms": {"type": "number"},
        "eager_ms": {"type": "number"},
    }
)
_SECTION = _obj(
    {
        "name": _STR,
        "description": _STR,
        "compiled_by_kiln": _BOOL,
        "graphs": _INT,
        "graphs_after_remedies": {"type": ["integer", "null"]},
        "single_graph": _BOOL,
        "breaks": {"type": "array", "items": _BREAK},
        "recompiles": {"type": "array", "items": _RECOMPILE},
        "fragments": {"type": "array", "items": _FRAGMENT},
        "edges": {"type": "array", "items": {"type": "array", "items": _STR, "minItems": 2, "maxItems": 2}},
        "timing": {"oneOf": [{"type": "null"}, _TIMING]},
        "notes": {"type": "array", "items": _STR},
        "summary": _SUMMARY,
    }
)
REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://kiln.invalid/report-schema.json",
    "title": "Kiln graph-break report",
    **_obj(
        {
            "schema_version": {"const": SCHEMA_VERSION},
            "target": _STR,
            "created": _STR,
            "versions": {"type": "object", "additionalProperties": _STR},
            "summary": _SUMMARY,
            "sections": {"type": "array", "items": _SECTION},
        }
    ),
}


def make_report(target: str, sections: list[Section]) -> Report:
    """A report on `target` from its analysed sections, stamped with versions and time."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("kiln", "torch", "transformers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "not installed"
    created = datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()
    return Report(target, sections, versions, created)
