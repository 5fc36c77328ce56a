"""Where a results file came from: the line each bench script writes first into bench/results/.

The docs link to those files instead of copying their numbers, so each file says itself which
command wrote it, when, and on what CPU (numbers from different hosts do not compare).
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line(argv: list[str] | None = None) -> str:
    """The command as it was run, from the repository root: `python bench/x.py --flag value`."""
    script, *args = sys.argv if argv is None else argv
    path = Path(script)
    shown = os.path.relpath(path) if path.is_absolute() else str(path)
    return shlex.join(["python", shown, *args])


def provenance(argv: list[str] | None = None, today: datetime.date | None = None) -> str:
    """One Markdown line: the command, the date, the host's CPU and how many CPUs it has."""
    day = (today or datetime.date.today()).isoformat()
    return f"Written by `{command_line(argv)}` on {day}; host CPU: {cpu_name()} ({os.cpu_count()} CPUs)."


def write_result(path: Path, report: str, argv: list[str] | None = None) -> None:
    """`report` into `path` under its provenance line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(provenance(argv) + "\n\n" + report.rstrip("\n") + "\n")
