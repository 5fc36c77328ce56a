"""What a compile reports while it runs, and the two ways `compile-model` shows it.

`kiln.compile(progress=callback)` calls `callback` with a `ProgressEvent` per phase start, phase
end and note. An event is the text line itself (a `str`: `print` it, or compare it), with what
a display needs beside it: `kind` ("start", "done", "failed" or "note"), `phase` (a stable id such as
"capture" or "save"), `title`, `elapsed_s` (on "done" and "failed") and `estimate_s` (on "start": the
seconds the phase took in the previous compile of a similar size, or None when there was none).

`compile-model` shows them as `ProgressBars` on a terminal (a bar with elapsed time and the time
left per phase, or a spinner with the elapsed time when nothing estimates the phase) and as
`ProgressLines` otherwise (CI, logs: one line per finished phase).
"""

from __future__ import annotations

import os
import sys
import threading
import time

PHASES = {  # id -> what it does; the order a compile runs them
    "locate": "locate the model",
    "cache": "look up the compile cache",
    "reuse": "copy the cached artifact",
    "load": "load the checkpoint",
    "breaks": "check graph breaks (Dynamo)",
    "capture": "capture the forward into IR",
    "passes": "run the pass pipeline",
    "lower": "lower",
    "wait-breaks": "wait for the graph-break check",
    "save": "save the artifact",
    "store": "store the artifact in the compile cache",
}


class ProgressEvent(str):
    """One progress line of a compile, with its phase, kind and times as attributes."""

    kind: str
    phase: str | None
    title: str | None
    elapsed_s: float | None
    estimate_s: float | None

    def __new__(
        cls,
        text: str,
        kind: str,
        phase: str | None = None,
        title: str | None = None,
        elapsed_s: float | None = None,
        estimate_s: float | None = None,
    ):
        event = super().__new__(cls, text)
        event.kind, event.phase, event.title = kind, phase, title
        event.elapsed_s, event.estimate_s = elapsed_s, estimate_s
        return event

    @classmethod
    def start(cls, phase: str, title: str, estimate_s: float | None) -> ProgressEvent:
        return cls(f"{title} ...", "start", phase, title, estimate_s=estimate_s)

    @classmethod
    def done(cls, phase: str, title: str, elapsed_s: float) -> ProgressEvent:
        return cls(f"{title}: done in {elapsed_s:.1f}s", "done", phase, title, elapsed_s=elapsed_s)

    @classmethod
    def failed(cls, phase: str, title: str, elapsed_s: float) -> ProgressEvent:
        return cls(f"{title}: failed after {elapsed_s:.1f}s", "failed", phase, title, elapsed_s=elapsed_s)

    @classmethod
    def note(cls, text: str) -> ProgressEvent:
        return cls(text, "note")


class ProgressLines:
    """One line per finished phase and per note, for logs: `[compile-model] capture ...: 12.3s`."""

    def __init__(self, stream=None, prefix: str = "[compile-model]"):
        self.stream, self.prefix = stream, prefix

    def __call__(self, event: str) -> None:
        if getattr(event, "kind", "note") == "start":
            return
        print(f"{self.prefix} {event}", file=self.stream or sys.stderr, flush=True)


class ProgressBars:
    """A live bar per phase on a terminal: elapsed time and the time left against the phase's
    estimate, or a spinner with the elapsed time when there is no estimate (or it ran over).
    Each finished phase leaves one line, as `ProgressLines` writes it."""

    TICK_S = 0.25
    SPINNER = "|/-\\"

    def __init__(self, stream=None, prefix: str = "[compile-model]"):
        self.stream, self.prefix = stream, prefix
        self._bar = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, event: str) -> None:
        kind = getattr(event, "kind", "note")
        if kind == "start":
            self._close()
            self._open(event)
        elif kind in ("done", "failed"):
            self._close()
            self._write(f"{self.prefix} {event}")
        else:
            self._write(f"{self.prefix} {event}")

    def _open(self, event: ProgressEvent) -> None:
        from tqdm import tqdm

        estimate = event.estimate_s if event.estimate_s and event.estimate_s > 0 else None
        stream = self.stream or sys.stderr
        sized = _columns(stream) > 0  # a terminal that reports no width gets 80 columns, not an empty bar
        self._bar = tqdm(
            total=estimate,
            file=stream,
            leave=False,
            dynamic_ncols=sized,
            ncols=None if sized else 80,
            nrows=None if sized else 24,
            desc=f"{self.prefix} {event.title}",
            bar_format=self._format(estimate),
        )
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, args=(self._bar, estimate), daemon=True)
        self._ticker.start()

    @staticmethod
    def _format(estimate: float | None, elapsed: float = 0.0) -> str:
        """tqdm's bar format; the time left is the estimate less the elapsed time (the phase
        gives no rate to extrapolate)."""
        if estimate is None:
            return "{desc} {elapsed} elapsed"
        from tqdm import tqdm

        return "{desc} |{bar}| {elapsed} elapsed, ~" + tqdm.format_interval(max(estimate - elapsed, 0)) + " left"

    def _tick(self, bar, estimate: float | None) -> None:
        """Move the bar with the clock: the phase reports nothing while it runs."""
        started, turn, title = time.monotonic(), 0, bar.desc
        while not self._stop.wait(self.TICK_S):
            elapsed = time.monotonic() - started
            if estimate is not None and elapsed < estimate:
                bar.n, bar.bar_format = elapsed, self._format(estimate, elapsed)
            else:
                if estimate is not None:  # ran over: spin, and say so
                    bar.total, bar.bar_format, estimate = None, self._format(None) + " (longer than last time)", None
                turn += 1
                bar.set_description_str(f"{title} {self.SPINNER[turn % len(self.SPINNER)]}", refresh=False)
            bar.refresh()

    def _close(self) -> None:
        if self._bar is None:
            return
        self._stop.set()
        self._ticker.join()
        self._bar.close()
        self._bar = None

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=self.stream or sys.stderr)


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def for_stream(stream=None, prefix: str = "[compile-model]"):
    """Bars on a terminal, lines otherwise."""
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    return (ProgressBars if isatty is not None and isatty() else ProgressLines)(stream, prefix)
