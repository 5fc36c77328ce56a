"""The graph-break corpus: every model breaks for its own reason, and the report must name the
right category at the right line; the eliminable ones must come out as one graph."""

from __future__ import annotations

import pytest

import break_corpus
from break_corpus import CASES, break_markers
from kiln.frontend.break_analysis import analyze
from kiln.frontend.explain_targets import module_subjects


@pytest.fixture(scope="module")
def sections():
    """Each corpus case analysed once (cost measured with the minimum of runs)."""
    cache = {}

    def analysed(case):
        if case.factory not in cache:
            module, inputs = getattr(break_corpus, case.factory)()
            [subject] = module_subjects(module, inputs, case.factory)
            cache[case.factory] = analyze(subject, runs=1)
        return cache[case.factory]

    return analysed


def test_the_corpus_breaks_for_at_least_ten_different_reasons(sections):
    reasons = {(b.category, b.gb_type, b.remedy) for case in CASES for b in sections(case).breaks}
    assert len(CASES) >= 10 and len(reasons) >= 10


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.factory)
def test_each_break_is_reported_at_its_line_in_its_category(case, sections):
    section = sections(case)
    expected = {line: category for name in case.classes for line, category in break_markers(name).items()}
    reported = {b.location.line: b.category for b in section.breaks}
    assert all(b.location.file == break_corpus.__file__ for b in section.breaks)
    assert reported == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.factory)
def test_eliminable_breaks_leave_one_graph_and_the_others_say_how_to_fix_them(case, sections):
    section = sections(case)
    assert section.breaks, "every corpus model breaks as written"
    if case.eliminable:
        assert section.single_graph and section.graphs_after_remedies == 1
        assert all(b.eliminated and b.remedy and b.remedy_how for b in section.breaks)
    else:
        assert not section.single_graph
        left = [b for b in section.breaks if not b.eliminated]
        assert left and all(b.fix and b.remedy is None for b in left)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.factory)
def test_each_break_carries_its_measured_cost_and_the_ops_around_it(case, sections):
    section = sections(case)
    assert section.timing is not None and section.timing.total_ms > 0
    for entry in section.breaks:
        assert entry.cost_ms is not None and entry.cost_ms >= 0
        assert entry.ops_before.count > 0  # each corpus break follows a linear layer
