"""bench/provenance.py: every results file a bench script writes starts with the command that
wrote it, the date and the host's CPU (the docs link to those files instead of copying them)."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from provenance import command_line, cpu_name, provenance, write_result


def test_the_line_names_the_command_the_date_and_the_cpu():
    line = provenance(["bench/step_cost.py", "--m", "1,2"], today=datetime.date(2026, 11, 26))
    assert line.startswith("Written by `python bench/step_cost.py --m 1,2` on 2026-11-26; host CPU: ")
    assert cpu_name() and cpu_name() in line


def test_an_absolute_script_path_is_shown_relative_and_arguments_are_quoted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "bench" / "bench.py"
    assert command_line([str(script), "--prompt", "a b"]) == "python bench/bench.py --prompt 'a b'"


def test_write_result_puts_the_line_above_the_report(tmp_path):
    out = tmp_path / "results" / "x.md"
    write_result(out, "| a |\n| --- |\n", argv=["bench/x.py"])
    first, blank, *table = out.read_text().splitlines()
    assert first.startswith("Written by `python bench/x.py` on ") and blank == ""
    assert table == ["| a |", "| --- |"]
