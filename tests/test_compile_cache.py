"""The compile cache and a compile's progress: a repeated compile reuses the artifact (checked
against its hashes first), other options or a damaged entry compile afresh, and every phase is
reported to the callback and, outside a terminal, as one line each."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from kiln import compile_cache
from kiln.cli import kiln_main
from kiln.compile_cache import CompileCache, cache_dir
from kiln.compile_progress import PHASES, ProgressBars, ProgressEvent
from kiln.ir.errors import OptionError
from kiln.runtime.artifact import manifest_sha256

COMPILED = ["locate", "cache", "load", "breaks", "capture", "passes", "lower", "save", "store"]
PROMPT = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        root = tmp_path_factory.mktemp("compile_cache")
        patch.setenv("KILN_COMPILE_CACHE", str(root))
        patch.setenv("KILN_BREAK_CHECK", "inline")
        # Kiln's source is part of the key; files edited in the checkout while the tests run must
        # not turn the hits these tests expect into misses.
        patch.setattr(compile_cache, "source_digest", lambda memo=None: "fixed for the tests")
        yield root


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs("llama")


def compile_tiny(model_dir, out, **options):
    events = []
    options = {"backend": "reference", "max_seq_len": 64, **options}
    path = kiln.compile(str(model_dir), out=out, progress=events.append, **options)
    return path, events


def phases(events, kind="done"):
    return [e.phase for e in events if e.kind == kind]


def entries_with(**options):
    """The cache entries compiled with these options (their key.json says)."""
    found = []
    for entry, _, _ in CompileCache(cache_dir()).entries():
        recorded = json.loads((entry / "key.json").read_text())["options"]
        if all(recorded[name] == value for name, value in options.items()):
            found.append(entry)
    return found


def tokens(path):
    return kiln.load(path).generate(PROMPT, max_new_tokens=8).token_ids


@pytest.fixture(scope="module")
def first(cache_root, model_dir, tmp_path_factory):
    """The first compile of the tiny llama: a miss, stored in the cache."""
    return compile_tiny(model_dir, tmp_path_factory.mktemp("first") / "m.kiln")


def test_the_callback_receives_every_phase_of_a_compile(first):
    _, events = first
    assert phases(events, "start") == COMPILED and phases(events) == COMPILED
    done = [e for e in events if e.kind == "done"]
    assert all(re.fullmatch(rf"{re.escape(e.title)}: done in \d+\.\ds", e) for e in done)  # the line's form
    assert set(COMPILED) <= set(PHASES)
    assert "graph breaks: 0 breaks found, 0 eliminated, 0 left" in events  # the summary stays a plain line
    assert "capture: every decoder layer traced (no two decoder layers alike after the first)" in events


def test_a_second_compile_hits_the_cache_and_generates_the_same_tokens(first, model_dir, tmp_path):
    path, events = compile_tiny(model_dir, tmp_path / "again.kiln")
    assert phases(events) == ["locate", "cache", "reuse"]
    assert any(e.kind == "note" and e.startswith("compile cache hit") for e in events)
    assert manifest_sha256(path) == manifest_sha256(first[0])  # the same artifact, file for file
    assert tokens(path) == tokens(first[0])


@pytest.mark.slow
def test_an_inductor_artifact_from_the_cache_loads_its_package_and_generates_the_same_tokens(
    cache_root, model_dir, tmp_path
):
    first_path, _ = compile_tiny(model_dir, tmp_path / "first.kiln", backend="inductor")
    path, events = compile_tiny(model_dir, tmp_path / "again.kiln", backend="inductor")
    assert phases(events) == ["locate", "cache", "reuse"]
    assert (path / "inductor.pt2").stat().st_ino == (first_path / "inductor.pt2").stat().st_ino  # linked, not copied
    assert tokens(path) == tokens(first_path)


def test_other_options_miss_the_cache(first, model_dir, tmp_path):
    path, events = compile_tiny(model_dir, tmp_path / "shorter.kiln", max_seq_len=32)
    assert "capture" in phases(events) and "reuse" not in phases(events)
    assert kiln.load(path).max_seq_len == 32
    assert len(CompileCache(cache_dir()).entries()) >= 2


def test_cache_false_compiles_afresh_with_estimates_from_the_last_compile(first, model_dir, tmp_path):
    _, events = compile_tiny(model_dir, tmp_path / "fresh.kiln", cache=False)
    assert "capture" in phases(events) and "cache" not in phases(events)
    starts = {e.phase: e for e in events if e.kind == "start"}
    assert starts["capture"].estimate_s is not None and starts["capture"].estimate_s > 0  # recorded by `first`


def test_a_damaged_entry_is_compiled_again_not_loaded(first, model_dir, tmp_path):
    [entry] = entries_with(backend="reference", max_seq_len=64)
    weights = entry / "artifact" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    damaged = weights.with_name("damaged")
    damaged.write_bytes(bytes(data))
    os.replace(damaged, weights)  # a new file: the artifacts hard-linked to the old one stay intact
    path, events = compile_tiny(model_dir, tmp_path / "after.kiln")
    assert any(e.kind == "note" and "damaged entry was deleted" in e and "weights.safetensors" in e for e in events)
    assert "capture" in phases(events) and "reuse" not in phases(events)
    assert tokens(path) == tokens(first[0])
    _, events = compile_tiny(model_dir, tmp_path / "hit.kiln")  # stored again, whole
    assert phases(events) == ["locate", "cache", "reuse"]


def test_kiln_cache_clear_empties_it(first, model_dir, tmp_path, capsys):
    compile_tiny(model_dir, tmp_path / "m.kiln")
    assert kiln_main(["cache", "info"]) == 0
    assert "artifact(s)" in capsys.readouterr().out
    assert kiln_main(["cache", "clear"]) == 0
    assert "deleted" in capsys.readouterr().out and CompileCache(cache_dir()).entries() == []


def test_the_least_recently_used_entries_go_beyond_the_size_bound(tmp_path):
    cache = CompileCache(tmp_path)
    for age, name in enumerate(["newest", "middle", "oldest"]):
        (tmp_path / name / "artifact").mkdir(parents=True)
        (tmp_path / name / "artifact" / "weights.safetensors").write_bytes(b"w" * 1000)
        os.utime(tmp_path / name, (1e9 - age * 100, 1e9 - age * 100))
    cache.evict(2500)
    assert [entry.name for entry, _, _ in cache.entries()] == ["middle", "newest"]
    cache.evict(0)
    assert cache.entries() == []


def test_a_malformed_size_bound_fails_before_the_compile(cache_root, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_COMPILE_CACHE_MAX_GB", "lots")
    with pytest.raises(OptionError, match="KILN_COMPILE_CACHE_MAX_GB='lots' is not a number of gigabytes"):
        compile_tiny(model_dir, tmp_path / "m.kiln")
    assert not (tmp_path / "m.kiln").exists()


def test_compile_model_prints_a_line_per_phase_outside_a_terminal(model_dir, tmp_path):
    """No bars, no start lines, and no library warnings in a clean compile's output."""
    env = {**os.environ, "KILN_COMPILE_CACHE": str(tmp_path / "cache"), "KILN_BREAK_CHECK": "inline"}
    command = [
        str(Path(sys.executable).parent / "compile-model"),
        str(model_dir),
        "-o",
        str(tmp_path / "m.kiln"),
        "--backend",
        "reference",
        "--max-seq-len",
        "64",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert all(line.startswith("[compile-model] ") for line in lines), lines
    done = [line.removeprefix("[compile-model] ").split(": done in ")[0] for line in lines if ": done in " in line]
    assert done == [
        f"locate {model_dir}",
        "look up the compile cache",
        f"load {model_dir}",
        "check graph breaks (Dynamo)",
        "capture the forward into IR",
        "run the pass pipeline",
        "lower with the reference backend",
        f"save the artifact to {tmp_path / 'm.kiln'}",
        "store the artifact in the compile cache",
    ]
    assert len(lines) == len(done) + 2  # and the graph-break and capture summaries
    assert not any("Warning" in line or "%|" in line for line in lines)


def test_progress_bars_leave_one_line_per_phase():
    stream = io.StringIO()
    bars = ProgressBars(stream)
    bars(ProgressEvent.start("capture", "capture the forward into IR", estimate_s=30.0))
    bars(ProgressEvent.done("capture", "capture the forward into IR", 12.5))
    bars(ProgressEvent.start("save", "save the artifact", estimate_s=None))
    bars(ProgressEvent.failed("save", "save the artifact", 1.0))
    text = stream.getvalue()
    assert "capture the forward into IR: done in 12.5s" in text and "save the artifact: failed after 1.0s" in text
    assert "left" in text  # the bar drawn against the estimate
