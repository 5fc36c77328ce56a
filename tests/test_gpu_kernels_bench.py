"""bench/gpu_kernels.py's dry run: every code path of the GPU kernels' micro-benchmark on the CPU
(Triton interpreted, toy shapes, one config each), so the one GPU run it is written for does not
fail on a path nothing here ran. Times are not checked: the interpreter's mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def table_rows(text: str, heading: str) -> list[str]:
    """The data rows of the first table after `heading`."""
    after = text.split(heading, 1)[1].split("\n\n", 2)[1]
    return [line for line in after.splitlines() if line.startswith("|")][2:]


def test_the_dry_run_reports_every_table(tmp_path):
    out = tmp_path / "kernels.md"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, str(ROOT / "bench" / "gpu_kernels.py"), "--dry", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for heading in ("## Products, bf16 / f16", "## Products, int8 per channel", "## Products, int4, groups of 32"):
        assert len(table_rows(text, heading)) == 10, heading  # 5 products at 1 and 2 rows
    assert len(table_rows(text, "## Decode attention")) == 4  # batch 1 and 2, two positions
    assert "skipped" in text or "not run" in text  # says what needs the GPU
    data = json.loads(out.with_suffix(".json").read_text())
    assert all(item["best"] and item["kiln error"] < 0.05 for item in data["products"])
    assert all(case["kiln error"] < 0.05 for case in data["attention"])
