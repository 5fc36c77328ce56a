"""Bad options on the command line: one line naming the problem and the fix, exit status 2, no
traceback, and nothing slow started. The slow steps (loading a model or an artifact) are replaced
by a sentinel that records being reached, so every test here runs in milliseconds."""

from __future__ import annotations

import argparse
import importlib
import random

import pytest
import torch

import kiln
from kiln import api, cli
from kiln.compile_options import CompileOptions, check_memory, kv_cache_bytes
from kiln.ir.errors import KilnError, OptionError


class ReachedSlowStep(Exception):
    """Raised by the stand-in of a slow step: the options got past every check."""


def _reached(*args, **kwargs):
    raise ReachedSlowStep


@pytest.fixture
def no_slow_steps(monkeypatch):
    """Loading a model, an artifact, a graph or an explain target raises ReachedSlowStep."""
    import kiln.frontend.checkpoint
    import kiln.frontend.default_model
    import kiln.frontend.explain_targets
    import kiln.ir_listing

    monkeypatch.setattr(kiln.frontend.checkpoint, "load_model", _reached)
    monkeypatch.setattr(kiln.frontend.checkpoint, "resolve_checkpoint_dir", _reached)  # a compile's first step
    monkeypatch.setattr(kiln.frontend.default_model, "default_model_dir", _reached)
    monkeypatch.setattr(kiln.frontend.explain_targets, "load_target", _reached)
    monkeypatch.setattr(kiln.ir_listing, "show_ir", _reached)
    monkeypatch.setattr(kiln, "load", _reached)  # first: resolving kiln.load reads api.load
    monkeypatch.setattr(api, "load", _reached)
    if importlib.util.find_spec("kiln.runtime.quality"):  # kiln quality reads two artifacts
        monkeypatch.setattr(importlib.import_module("kiln.runtime.quality"), "quality", _reached)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # a random --threads 1024 would leave the suite 1024 spinning threads


def run_cli(main, argv, capsys) -> tuple[str, int | None]:
    """('slow', None) if the slow step was reached, else ('exit', status) with stderr checked to be
    one error line with a fix and no traceback."""
    try:
        status = main(argv)
    except ReachedSlowStep:
        capsys.readouterr()
        return "slow", None
    err = capsys.readouterr().err
    assert status == cli.EXIT_USAGE, (argv, status, err)
    assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert "Traceback" not in err and "Fix" in err, (argv, err)
    return "exit", status


# -- the bad options of a compile, each ------------------------------------------------------------
COMPILE_MISTAKES = [
    (["--device", "cuda", "--backend", "reference"], "device 'cuda': the reference backend runs on the CPU only"),
    (["--backend", "onnxruntime", "--dtype", "f16"], "dtype 'f16' is for GPUs"),
    (["--max-seq-len", "-5"], "max_seq_len must be a whole number of at least 1, got -5"),
    (["--max-batch", "0"], "max_batch must be a whole number of at least 1, got 0"),
    (["--tensor-parallel", "0"], "tensor_parallel must be a whole number of at least 1, got 0"),
    (["--device", "tpu"], "device 'tpu' is not one Kiln targets"),
    (["--quantize", "int3"], "unknown quantization scheme 'int3'"),
    (["--quantize-embeddings"], "no scheme is given"),
    (["--calibration", "text.txt"], "calibration is read only by the data-aware (-awq) schemes"),
    (["--quantize", "int4-g64-awq", "--calibration", "missing.txt"], "calibration file"),
    (["--tensor-parallel", "2", "--backend", "onnxruntime"], "cannot run a tensor-parallel graph"),
    (["--tensor-parallel", "2", "--quantize", "int8"], "does not shard quantized weights"),
    (["--kv-cache", "int4"], "kv_cache 'int4' is not a KV-cache kind"),
    (["--kv-cache", "int8", "--backend", "onnxruntime"], "not supported by the onnxruntime backend"),
    (["--kv-cache", "int8", "--backend", "tinygrad"], "not supported by the tinygrad backend"),
    (["--kv-cache", "int8", "--tensor-parallel", "2"], "not sharded over ranks"),
    (["--max-batch", "two"], "argument --max-batch: invalid int value: 'two'"),
    (["--backend", "tensorrt"], "argument --backend: invalid choice: 'tensorrt'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize("flags,message", COMPILE_MISTAKES, ids=[" ".join(f) for f, _ in COMPILE_MISTAKES])
def test_a_bad_compile_option_is_one_line_before_the_model_loads(flags, message, tmp_path, capsys, no_slow_steps):
    (tmp_path / "text.txt").write_text("calibration text")
    flags = [str(tmp_path / f) if f.endswith(".txt") else f for f in flags]
    try:
        status = cli.compile_model_main([str(tmp_path), "-o", str(tmp_path / "m.kiln"), *flags])
    except ReachedSlowStep:
        pytest.fail(f"{flags} reached the model's load")
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert message in err and "Fix" in err


def test_output_paths_that_cannot_be_written_are_refused_first(tmp_path, capsys, no_slow_steps):
    a_file = tmp_path / "a-file"
    a_file.write_text("not an artifact")
    for flags, message in [
        (["-o", str(a_file)], "is not a Kiln artifact"),
        (["-o", str(a_file / "m.kiln")], "is a file"),
        (["-o", str(tmp_path / "m.kiln"), "--dump-ir", str(a_file)], "is not a directory"),
    ]:
        assert cli.compile_model_main([str(tmp_path), *flags]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_kiln_compile_raises_an_option_error_a_value_error_too(tmp_path, no_slow_steps):
    with pytest.raises(OptionError, match="max_seq_len must be a whole number") as info:
        kiln.compile(str(tmp_path), out=tmp_path / "m.kiln", max_seq_len=-5)
    assert isinstance(info.value, KilnError) and isinstance(info.value, ValueError)
    for bad in (0, 1.5, True, "8", None):
        with pytest.raises(OptionError, match="max_batch"):
            kiln.compile(str(tmp_path), out=tmp_path / "m.kiln", max_batch=bad)
    with pytest.raises(ReachedSlowStep):  # good options get as far as the load
        kiln.compile(str(tmp_path), out=tmp_path / "m.kiln", max_seq_len=64, max_batch=4)


class Config:
    num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 30, 9, 3, 576


def test_a_kv_cache_larger_than_memory_is_refused_before_the_capture(tmp_path):
    options = CompileOptions.checked(model=None, out=tmp_path / "m.kiln", max_seq_len=2048, max_batch=4)
    # SmolLM2-135M: 2 (k, v) x 30 layers x 3 kv heads x 64 dims x 4 bytes per position and row, + rope tables
    assert kv_cache_bytes(Config(), options) == (2 * 30 * 4 * 3 * 64 * 4 + 64 * 4) * 2048
    check_memory(Config(), options)
    huge = CompileOptions.checked(model=None, out=tmp_path / "m.kiln", max_seq_len=10**12)
    with pytest.raises(OptionError, match=r"needs a KV cache of .* GB.*Fix: a smaller --max-seq-len"):
        check_memory(Config(), huge)
    assert kv_cache_bytes(object(), huge) is None  # a config that does not say its shape: not checked


def test_the_memory_check_runs_between_load_and_capture(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    import kiln.frontend.capture

    monkeypatch.setattr(kiln.frontend.capture, "capture_causal_lm", _reached)
    assert (
        cli.compile_model_main(
            [str(tiny_model_dirs("llama")), "-o", str(tmp_path / "m.kiln"), "--max-seq-len", str(10**14)]
        )
        == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: max_batch=1 x max_seq_len=100000000000000 needs a KV cache")


# -- the kiln command's bad options ----------------------------------------------------------------
KILN_MISTAKES = [
    (["generate", "{a}", "--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens must be 0 or more"),
    (["generate", "{a}", "--prompt", "x", "--temperature", "nan"], "temperature must be a finite number"),
    (["generate", "{a}", "--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "{a}", "--prompt", "x", "--seed", "-1"], "--seed must be in [0, 2**63)"),
    (["generate", "{a}"], "the following arguments are required: --prompt"),
    (["chat", "{a}", "--top-k", "-3"], "top_k must be >= 0"),
    (["serve", "{a}", "--port", "70000"], "--port must be in [1, 65535]"),
    (["serve", "{a}", "--max-queue", "0"], "--max-queue must be at least 1"),
    (["serve", "{a}", "--max-body-bytes", "-1"], "--max-body-bytes must be at least 1"),
    (["serve", "{a}", "--allowed-hosts", ","], "--allowed-hosts names no host"),
    (["ir", "{a}", "--max-seq-len", "0"], "--max-seq-len must be at least 1"),
    (["quality", "{a}", "--reference", "{a}", "--window", "0"], "--window must be at least 1"),
    (["quality", "{a}", "--reference", "{a}", "--windows", "-2"], "--windows must be at least 1"),
    (["bench", "{a}"], "argument command: invalid choice: 'bench'"),
]


@pytest.mark.parametrize("argv,message", KILN_MISTAKES, ids=[" ".join(a) for a, _ in KILN_MISTAKES])
def test_a_bad_kiln_option_is_one_line_before_the_artifact_loads(argv, message, tmp_path, capsys, no_slow_steps):
    argv = [str(tmp_path) if a == "{a}" else a for a in argv]
    assert run_cli(cli.kiln_main, argv, capsys) == ("exit", 2)


def test_compile_model_explain_checks_its_options_before_capturing(tmp_path, capsys, no_slow_steps):
    assert run_cli(cli.compile_model_main, ["explain", str(tmp_path), "--sections", "forward,backward"], capsys) == (
        "exit",
        2,
    )
    assert run_cli(cli.compile_model_main, ["explain", str(tmp_path), "-o", str(tmp_path)], capsys) == ("exit", 2)
    assert run_cli(cli.compile_model_main, ["explain", str(tmp_path), "--format", "pdf"], capsys) == ("exit", 2)


# -- a fuzz of every flag --------------------------------------------------------------------------
JUNK = ["", "abc", "-", "1e3", "0x10", "nan", "inf", "-inf", "None", "---", " 7", "１２", "1_000", "x" * 300]
INTS = [-(2**63), -(10**12), -5, -1, 0, 1, 2, 3, 7, 64, 1024, 2**31, 2**63, 10**30]
FLOATS = ["nan", "inf", "-inf", "-1", "0", "1e-320", "0.5", "1", "1.5", "99", "1e308", "-0.0"]
# Flags whose values the checks must refuse when below 1 (counts of something).
COUNTS = {
    "--max-seq-len",
    "--max-batch",
    "--tensor-parallel",
    "--max-queue",
    "--max-body-bytes",
    "--window",
    "--windows",
}


def _value(action: argparse.Action, rng: random.Random, paths: list[str]) -> tuple[str, bool]:
    """A random value for `action`, and whether the checks must refuse it."""
    if action.choices and rng.random() < 0.7:
        return str(rng.choice(list(action.choices))), False
    if action.type is int and rng.random() < 0.8:
        number = rng.choice(INTS + [rng.randint(-(10**6), 10**6)])
        return str(number), action.option_strings[-1] in COUNTS and number < 1
    if action.type is float and rng.random() < 0.8:
        text = rng.choice(FLOATS + [str(rng.uniform(-10, 10))])
        return text, text in ("nan", "inf", "-inf")
    text = rng.choice(JUNK + paths)
    junk_number = action.type in (int, float) and not _parses(action.type, text)
    return text, junk_number or (bool(action.choices) and text not in action.choices)


def _parses(kind, text: str) -> bool:
    try:
        kind(text)
        return True
    except ValueError:
        return False


def _random_argv(
    parser: argparse.ArgumentParser, positional: list[str], rng: random.Random, paths: list[str]
) -> tuple[list[str], bool]:
    """A command line of `parser` with a random subset of its flags (each required one always),
    and whether it must be refused."""
    argv, must_refuse = list(positional), False
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if not action.required and rng.random() < 0.5:
            continue
        flag = rng.choice(action.option_strings)
        if action.nargs == 0:  # store_true
            argv.append(flag)
            continue
        value, bad = _value(action, rng, paths)
        argv += [f"{flag}={value}"]  # = keeps values that start with '-' a value
        must_refuse |= bad
    if rng.random() < 0.05:
        argv.append("--not-a-flag")
        must_refuse = True
    return argv, must_refuse


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_random_values_of_every_flag_give_one_line_errors_and_no_traceback(tmp_path, capsys, no_slow_steps):
    """Random command lines of compile-model, compile-model explain and every kiln command: each
    either gets past every check (and reaches the stand-in of the slow step) or fails in one line
    with a fix; a value that must be refused (a count below 1, nan, a junk number) always is."""
    rng = random.Random(0)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "model").mkdir()
    paths = [str(tmp_path / "a-file"), str(tmp_path / "model"), str(tmp_path / "new" / "x"), "cuda", "cpu:1"]
    kiln_commands = _subparsers(cli.kiln_parser())
    mains = [
        (cli.compile_model_main, cli.compile_parser(), []),
        (cli.compile_model_main, cli.explain_parser(), ["explain"]),
    ]
    mains += [(cli.kiln_main, parser, [name]) for name, parser in sorted(kiln_commands.items())]
    outcomes = {"slow": 0, "exit": 0}
    for _ in range(120):
        for main, parser, prefix in mains:
            positional = [str(tmp_path / "model")] * sum(
                1 for a in parser._actions if not a.option_strings and not isinstance(a, argparse._HelpAction)
            )
            argv, must_refuse = _random_argv(parser, positional, rng, paths)
            outcome, _ = run_cli(main, prefix + argv, capsys)
            assert not (must_refuse and outcome == "slow"), f"{prefix + argv} was not refused"
            outcomes[outcome] += 1
    assert outcomes["slow"] > 50 and outcomes["exit"] > 50, outcomes  # both sides were explored
