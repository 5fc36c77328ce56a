"""The graph-break report in its three forms (JSON against its schema, Markdown, HTML opened
by headless Chromium), the `compile-model explain` command, and the recompile explanations."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

import break_corpus
from kiln.cli import compile_model_main
from kiln.frontend.break_analysis import analyze
from kiln.frontend.explain_targets import module_subjects
from kiln.frontend.guard_failures import diagnose_guard
from kiln.frontend.report_html import render_html
from kiln.frontend.report_markdown import render_markdown
from kiln.frontend.report_model import REPORT_SCHEMA, make_report

CORPUS = Path(break_corpus.__file__)
SCHEMA_FILE = Path(__file__).parent.parent / "docs" / "report-schema.json"


@pytest.fixture(scope="module")
def report():
    """A report with one eliminated break (tensor_if) and one left (tensor_while, a loop)."""
    sections = []
    for factory in ("tensor_if", "tensor_while"):
        module, inputs = getattr(break_corpus, factory)()
        [subject] = module_subjects(module, inputs, factory)
        subject.name = factory
        sections.append(analyze(subject, runs=1))
    return make_report("tests/break_corpus.py", sections)


def test_json_report_follows_the_documented_schema(report):
    jsonschema.validate(report.to_json(), REPORT_SCHEMA)
    assert json.loads(SCHEMA_FILE.read_text()) == REPORT_SCHEMA, "docs/report-schema.json is out of date"


def test_json_report_counts_breaks_found_eliminated_and_left(report):
    data = report.to_json()
    assert data["summary"]["breaks_found"] == 2
    assert data["summary"]["eliminated"] == 1 and data["summary"]["left"] == 1
    assert report.summary_line() == "2 breaks found, 1 eliminated, 1 left"


def test_markdown_shows_each_break_with_its_source_reason_cost_and_fix(report):
    text = render_markdown(report)
    line = next(iter(break_corpus.break_markers("TensorWhile")))
    assert f"break_corpus.py:{line}` in `forward`" in text
    assert f"> {line} |         while h.abs().max() > 1.0:" in text  # the line itself, marked, with context
    assert "**Why:**" in text and "**Fix:**" in text and "eliminated (branch_to_select)" in text
    assert re.search(r"\| B1 \| data-dependent control flow \| .* \| \d+\.\d{3} ms \| \d+\.\d% \|", text)


def test_html_report_is_one_file_with_the_fragments_graph_as_svg(report):
    page = render_html(report)
    assert page.count("<svg") == 2 and "<script" not in page
    assert not re.search(r"(src|href)=['\"]https?:", page), "the page must not load anything"


def test_html_report_opens_in_headless_chromium_without_errors(report, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: `apt-get install -y chromium`)")
    page = tmp_path / "report.html"
    page.write_text(render_html(report), encoding="utf-8")
    run = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []
    assert "<svg" in run.stdout and "Graph-break report" in run.stdout and "tensor_while" in run.stdout


def test_explain_command_writes_the_report_in_each_format(tmp_path, capsys):
    target = f"{CORPUS}:print_in_forward"
    for fmt in ("json", "md", "html"):
        out = tmp_path / f"report.{fmt}"
        assert compile_model_main(["explain", target, "--format", fmt, "-o", str(out)]) == 0
        assert out.stat().st_size > 0
    data = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(data, REPORT_SCHEMA)
    [entry] = data["sections"][0]["breaks"]
    assert entry["category"] == "python_side_effect" and entry["eliminated"]
    assert "1 break found, 1 eliminated, 0 left" in capsys.readouterr().err


def test_explain_names_a_bad_target_and_the_fix(tmp_path, capsys):
    assert compile_model_main(["explain", f"{CORPUS}:no_such_factory"]) == 2
    assert "has no callable `no_such_factory`" in capsys.readouterr().err


def test_compile_model_still_takes_the_model_as_its_first_argument(tmp_path, capsys):
    assert compile_model_main([str(tmp_path / "missing-model"), "-o", str(tmp_path / "out")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "guard,category,value",
    [
        (
            "0/0: tensor 'kwargs['input_ids']' size mismatch at index 1. expected 7, actual 1",
            "dynamic_shape",
            "dim 1: 7 -> 1",
        ),
        (
            "0/1: tensor 'kwargs['past_key_values'].layers[0].keys' size mismatch at index 2. expected 7, actual 8",
            "dynamic_shape",
            "dim 2: 7 -> 8",
        ),
        ("18/1: 2 <= input_ids.size()[1] <= 9  # is_done = torch.full(...)", "dynamic_shape", "outside the range"),
        ("3/0: L['n'] == 4", "value_specialization", "was 4"),
        (
            "1/0: tensor 'x' dtype mismatch. expected Float, actual Half",
            "tensor_property",
            "dtype expected Float, actual Half",
        ),
    ],
)
def test_each_failed_guard_is_explained(guard, category, value):
    diagnosis = diagnose_guard(guard)
    assert (diagnosis.category, diagnosis.value) == (category, value)
    assert diagnosis.plain and diagnosis.fix and not diagnosis.guard.startswith(guard[:4])


def test_a_growing_cache_is_named_as_such():
    diagnosis = diagnose_guard(
        "0/1: tensor 'kwargs['past_key_values'].layers[0].keys' size mismatch at index 2. expected 7, actual 8"
    )
    assert "KV cache grew" in diagnosis.plain and "static KV cache" in diagnosis.kiln
