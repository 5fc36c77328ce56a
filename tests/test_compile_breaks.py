"""Graph breaks in real models: every compile writes the report into the artifact and fails on
a break Kiln cannot remove; `explain` reports a Hugging Face model's forward (one graph, the
recompiles as the cache grows) and `model.generate` (its breaks, each with a fix)."""

from __future__ import annotations

import json
import types
import zlib

import jsonschema
import pytest

import kiln
from kiln.frontend.break_analysis import analyze
from kiln.frontend.checkpoint import load_model
from kiln.frontend.compile_breaks import GraphBreakError, check_graph_breaks
from kiln.frontend.explain_targets import model_subjects
from kiln.frontend.report_model import REPORT_SCHEMA
from kiln.runtime.artifact import read_artifact


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dirs):
    return load_model(tiny_model_dirs("llama")).model


@pytest.mark.parametrize(("mode", "arch"), [("inline", "llama"), ("background", "gemma3")])
def test_compile_writes_the_break_report_into_the_artifact(tiny_model_dirs, tmp_path, monkeypatch, mode, arch):
    """Inline, or in a child process beside the capture (what large models get on 2+ cores),
    which checks the decoder layers the capture traces: Gemma 3's first three of its four."""
    monkeypatch.setenv("KILN_BREAK_CHECK", mode)
    lines = []
    path = kiln.compile(
        str(tiny_model_dirs(arch)),
        out=tmp_path / "m.kiln",
        backend="reference",
        max_seq_len=64,
        progress=lines.append,
    )
    contents = read_artifact(path)  # the report files are listed and hashed like the rest
    assert {"report.md", "report.json"} <= set(contents.manifest["files"])
    assert contents.manifest["graph_breaks"] == {"breaks_found": 0, "eliminated": 0, "left": 0, "recompiles": 0}
    assert "graph breaks: 0 breaks found, 0 eliminated, 0 left" in lines
    report = json.loads((path / "report.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    [section] = report["sections"]
    assert section["name"] == "stateless forward" and section["single_graph"] and section["graphs"] == 1
    assert "captured this as one graph" in (path / "report.md").read_text()
    layers = [n for n in section["notes"] if n.startswith("checked with")]
    assert layers == (
        []
        if mode == "inline"
        else [
            "checked with 3 of 4 decoder layers traced (the first and 2 kind(s)); the other layers are alike, "
            "so timing and op counts are those of 3 layers"
        ]
    )


def _norm_with_checksum(self, hidden):
    zlib.crc32(b"kiln")  # a C-extension call Dynamo cannot trace
    return type(self).forward(self, hidden)


def test_a_break_kiln_cannot_remove_fails_the_compile_with_the_report(tiny_model_dirs):
    lm = load_model(tiny_model_dirs("llama")).model
    lm.model.norm.forward = types.MethodType(_norm_with_checksum, lm.model.norm)
    with pytest.raises(GraphBreakError) as failure:
        check_graph_breaks(lm, "tiny-llama")
    message = str(failure.value)
    line = _norm_with_checksum.__code__.co_firstlineno + 1
    assert f"test_compile_breaks.py:{line}" in message and "`zlib.crc32`" in message and "Fix:" in message
    left = {b.location.line: b.category for b in failure.value.report.sections[0].breaks if not b.eliminated}
    assert left[line] == "unsupported_call"


def test_explain_a_forward_with_dynamic_cache_reports_one_graph_and_the_cache_recompiles(tiny_llama):
    [subject] = model_subjects(tiny_llama, ("forward",))
    section = analyze(subject, runs=1)
    assert section.breaks == [] and section.single_graph
    assert "captured this as one graph" in section.notes[0]
    sources = {r.source: r for r in section.recompiles}
    assert {"kwargs['input_ids']", "kwargs['past_key_values'].layers[0].keys"} <= set(sources)
    assert sources["kwargs['past_key_values'].layers[0].keys"].value == "dim 2: 7 -> 8"
    assert all(r.category == "dynamic_shape" and r.kiln for r in section.recompiles)


@pytest.fixture(scope="module")
def generate_section(tiny_llama):
    [subject] = model_subjects(tiny_llama, ("generate",))
    return analyze(subject, runs=1)


def test_explain_generate_finds_its_breaks_and_explains_each(generate_section):
    section = generate_section
    assert not section.compiled_by_kiln and "Kiln does not compile `generate`" in section.notes[0]
    kinds = {b.gb_type for b in section.breaks}
    assert len(section.breaks) >= 5 and len(kinds) >= 4
    special_tokens = [b for b in section.breaks if b.location.function == "_prepare_special_tokens"]
    assert special_tokens and all(b.category == "data_dependent_control_flow" for b in special_tokens)
    assert {"generic_jump TensorVariable()", "step_unsupported"} <= {b.dynamo_reason for b in section.breaks}
    for entry in section.breaks:
        assert entry.reason and entry.fix and entry.cost_ms is not None and not entry.eliminated
        assert "site-packages/transformers/" in entry.location.file
    costs = [b.cost_ms for b in section.breaks]
    assert costs == sorted(costs, reverse=True)


@pytest.mark.slow
def test_explain_smollm2_forward_captures_one_graph_and_reports_the_recompiles(smollm2_dir):
    lm = load_model(smollm2_dir).model
    [subject] = model_subjects(lm, ("forward",))
    section = analyze(subject, runs=1)
    assert section.breaks == [] and section.graphs == 3  # prefill, decode, decode with a dynamic cache length
    assert [r.value for r in section.recompiles] == ["dim 1: 7 -> 1", "dim 2: 7 -> 8"]
    assert section.timing is not None and section.timing.total_ms > 0
