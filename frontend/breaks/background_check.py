"""The compile's graph-break check in a child process, beside the capture.

Dynamo's trace of a large model (about 40 s for SmolLM2-135M here) and Kiln's own capture are
both single-threaded Python, so on a machine with a spare core the compile runs them side by
side: the child loads the checkpoint again and checks it while the parent captures, optimizes
and lowers. The child checks the decoder layers the capture traces, one per kind
(`check_layer_templates`): the capture got that much shorter, and the wait for a full check
would have eaten what it saved. The child's verdict is final only when the forward is clean (one graph, no break
to remove, the common case). Otherwise the parent runs the check itself: that one raises
GraphBreakError with the full report, or applies Kiln's branch rewrites to the model it is
about to capture (which a child cannot do), and the caller captures again.

    python -m kiln.frontend.breaks.background_check MODEL_DIR OUT.json   (what the child runs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PARALLEL_MIN_PARAM_BYTES = 64 * 2**20  # below this the check takes seconds: a child would cost more


@dataclass
class CleanBreaks:
    """The result of a clean check, as much of a Report as a compile uses."""

    counts: dict[str, int]
    files: dict[str, str]
    line: str

    def summary_line(self) -> str:
        return self.line


class BackgroundBreakCheck:
    """A running child check; `clean_result()` waits for it."""

    def __init__(self, model_dir: Path, target: str):
        self._out = Path(tempfile.mkstemp(prefix="kiln-breaks-", suffix=".json")[1])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the parent's threads keep the other core
        self._process = subprocess.Popen(
            [sys.executable, "-m", "kiln.frontend.breaks.background_check", str(model_dir), target, str(self._out)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def clean_result(self) -> CleanBreaks | None:
        """The child's result if the forward is clean; None if the parent must check itself
        (breaks found, or the child failed)."""
        self._process.communicate()
        try:
            data = json.loads(self._out.read_text()) if self._process.returncode == 0 else None
        except ValueError:
            data = None
        finally:
            self._out.unlink(missing_ok=True)
        if not data or data["counts"]["breaks_found"]:
            return None
        return CleanBreaks(data["counts"], data["files"], data["summary_line"])

    def cancel(self) -> None:
        self._process.kill()
        self._process.wait()
        self._out.unlink(missing_ok=True)


def start_if_worthwhile(model_dir: Path, param_bytes: int, target: str) -> BackgroundBreakCheck | None:
    """A child check when the model is big enough and another core is there to run it."""
    mode = os.environ.get("KILN_BREAK_CHECK", "auto")  # auto | inline | background
    if mode == "inline" or (mode == "auto" and (param_bytes < PARALLEL_MIN_PARAM_BYTES or (os.cpu_count() or 1) < 2)):
        return None
    return BackgroundBreakCheck(model_dir, target)


def _main(model_dir: str, target: str, out: str) -> int:
    import torch

    from kiln.frontend.breaks.compile_check import report_files
    from kiln.frontend.checkpoint import load_model

    torch.set_num_threads(1)
    report = check_layer_templates(load_model(model_dir).model, target)  # GraphBreakError: exit 1, parent rechecks
    Path(out).write_text(
        json.dumps({"counts": report.counts, "files": report_files(report), "summary_line": report.summary_line()})
    )
    return 0


def check_layer_templates(lm, target: str):
    """The check on the model with one decoder layer per kind, the layers the capture traces
    (frontend/layer_templates.py): the others run the same code, so the verdict is theirs too,
    and Dynamo's trace is as much shorter as the capture's. Its report says so in a note."""
    from kiln.frontend.breaks.compile_check import check_graph_breaks
    from kiln.frontend.layer_templates import plan_layers, templates_only

    plan = plan_layers(lm)
    if isinstance(plan, str):
        return check_graph_breaks(lm, target)
    with templates_only(lm, plan):
        report = check_graph_breaks(lm, target)
    report.sections[0].notes.append(
        f"checked with {plan.summary()}; the other layers are alike, so timing and op counts are those of "
        f"{len(plan.templates)} layers"
    )
    return report


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:4]))
