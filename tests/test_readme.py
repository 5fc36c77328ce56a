"""README.md's examples run, so the guide cannot drift from the code.

Each fenced block after a `<!-- tested -->` line runs against the tiny Llama: `sh` blocks line by
line through the CLIs' entry points (in this process), `python` blocks as written. The test
substitutes the tiny checkpoint (or its GGUF) for the model paths and the default model, a
temporary directory for the output paths (a tiny reward model for `reward.kiln`), and compiles
with ONNX Runtime, which lowers a tiny model in seconds (each backend has tests of its own);
everything else runs as the README shows it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import kiln
from kiln import cli
from tiny_models import TRAINING_TEXT, save_tiny_gguf, save_tiny_reward_model

README = Path(__file__).resolve().parent.parent / "README.md"
MARK = "<!-- tested -->"
BACKEND = "onnxruntime"
MAINS = {"compile-model": cli.compile_model_main, "kiln": cli.kiln_main}


def marked_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block that directly follows the mark."""
    pattern = re.compile(rf"^{re.escape(MARK)}\n```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    return pattern.findall(text)


def blocks_of(language: str) -> list[str]:
    return [code for lang, code in marked_blocks(README.read_text()) if lang == language]


@pytest.fixture(scope="module")
def paths(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    """What each placeholder of the README stands for here."""
    root = tmp_path_factory.mktemp("readme")
    llama = tiny_model_dirs("llama")
    (root / "book.txt").write_text(TRAINING_TEXT * 4)
    paths = {
        "path/to/hf-model": str(llama),
        "path/to/model.gguf": str(save_tiny_gguf(llama, root / "tiny-llama.gguf")),
        "out/": f"{root}/out/",
        "model.kiln": str(root / "model.kiln"),
        "book.txt": str(root / "book.txt"),
        "breaks.html": str(root / "breaks.html"),
    }
    if any("reward.kiln" in code for _, code in marked_blocks(README.read_text())):  # a tiny one stands in
        reward_model = save_tiny_reward_model("llama", root / "tiny-reward")
        reward = kiln.compile(str(reward_model), out=root / "reward.kiln", backend=BACKEND, max_seq_len=64)
        paths["reward.kiln"] = str(reward)
    return paths


def substituted(code: str, paths: dict[str, str]) -> str:
    for placeholder, path in paths.items():
        code = re.sub(rf"(?<![\w/.-]){re.escape(placeholder)}", path, code)
    return code


def command_lines(code: str, paths: dict[str, str]) -> list[list[str]]:
    """The block's commands as argv lists, each compile on BACKEND and the default model replaced."""
    commands = []
    for line in code.splitlines():
        argv = shlex.split(substituted(line, paths), comments=True)
        if not argv:
            continue
        if argv[:2] == ["compile-model", "-o"]:  # no MODEL: the bundled SmolLM2
            argv.insert(1, paths["path/to/hf-model"])
        if argv[0] == "compile-model" and argv[1] != "explain" and "--backend" not in argv:
            argv += ["--backend", BACKEND]
        commands.append(argv)
    return commands


def test_the_readme_marks_a_cli_block_and_a_python_block():
    assert len(blocks_of("sh")) >= 1 and len(blocks_of("python")) >= 1
    assert all(line.split()[0] in MAINS for code in blocks_of("sh") for line in code.splitlines() if line.strip())


def test_the_readme_cli_examples_run(paths, capsys):
    commands = [argv for code in blocks_of("sh") for argv in command_lines(code, paths)]
    for argv in commands:
        status = MAINS[argv[0]](argv[1:])
        _, err = capsys.readouterr()
        assert status in (0, None), f"`{shlex.join(argv)}` exited {status}: {err.strip()[-500:]}"
    assert Path(paths["out/"], "m-int4.kiln", "manifest.json").is_file()
    assert Path(paths["breaks.html"]).read_text().lstrip().lower().startswith("<!doctype html")


def test_the_readme_python_quick_start_runs(paths, capsys):
    for code in blocks_of("python"):
        code = substituted(code, paths).replace('backend="inductor"', f'backend="{BACKEND}"')
        namespace: dict = {}
        exec(compile(code, f"{README}:python", "exec"), namespace)
        assert namespace["result"].token_ids and isinstance(namespace["reply"].text, str)
    assert "tok/s" in capsys.readouterr().out  # result.stats.summary() was printed


def test_placeholders_are_replaced_only_where_they_stand_alone():
    paths = {"out/": "/tmp/x/out/", "model.kiln": "/tmp/x/model.kiln"}
    line = "compile-model -o out/m.kiln --dump-ir out/ir  # see docs/out/ and my.model.kiln"
    assert substituted(line, paths) == (
        "compile-model -o /tmp/x/out/m.kiln --dump-ir /tmp/x/out/ir  # see docs/out/ and my.model.kiln"
    )
