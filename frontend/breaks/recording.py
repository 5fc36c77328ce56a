"""Run a callable under Dynamo and record what it hits: every graph break, every compiled
fragment (a graph between breaks) and every recompile with the guards that failed.

torch 2.13 reports these in three places, each hooked only for the length of one capture:
- `InstructionTranslatorBase.log_graph_break`: each break Dynamo resumes after or falls back on,
  with its `Unsupported` exception (`gb_type`, message, the user stack);
- `convert_frame.format_error_msg`: breaks that make Dynamo skip a whole frame (it formats each
  one it suppresses, with the exception and the frame);
- `convert_frame.get_and_maybe_log_recompilation_reasons`: one call per recompile, with the guards.
The backend records each graph Dynamo hands it and returns it wrapped in a timer, so that
`cost.py` can time the same compiled code afterwards without compiling again. Graphs run
eagerly (`gm.forward`): the capture is about where the graphs end, not about kernels.
"""

from __future__ import annotations

import functools
import linecache
import re
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

Workload = Callable[[Callable], Any]  # runs the (optimized) function once or more, returns its outputs

_RESUME_NAME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")
_CANNOT_RESUME = "Encountered graph break that we cannot resume from"  # symbolic_convert's words


@dataclass(frozen=True)
class SourceFrame:
    """One frame of user code: where Dynamo was when something happened."""

    filename: str
    lineno: int
    function: str  # Dynamo's resume functions are named back after the function they resume

    @property
    def line(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


@dataclass
class BreakEvent:
    """Dynamo could not trace a step: the graph ends here, or the whole function runs eagerly."""

    gb_type: str  # Dynamo's context-free name of the break ("Data-dependent branching", ...)
    message: str  # Dynamo's full text: explanation, hints, developer context
    stack: list[SourceFrame]  # outermost first; the last frame is where the break happened
    skipped_frame: bool  # Dynamo gave up on the whole function and ran it eagerly
    order: int = 0


@dataclass
class Fragment:
    """One graph Dynamo compiled: the code between two breaks (or a whole function)."""

    index: int
    ops: list[str]  # the graph's calls in order: aten/torch functions, methods, submodules
    reason: str  # why Dynamo ended the graph here: "return_value", "generic_jump ...", ...
    ended_by_break: bool
    stack: list[SourceFrame]
    order: int = 0


@dataclass
class RecompileEvent:
    """Dynamo compiled a function again because the guards of every earlier compile failed."""

    function: str
    filename: str
    lineno: int
    guards: list[str]  # one failure per earlier compile, the most recent first
    order: int = 0


@dataclass
class FragmentTimer:
    """Start and end times of each fragment run, kept only while `active`."""

    active: bool = False
    spans: list[tuple[int, float, float]] = field(default_factory=list)


@dataclass
class DynamoCapture:
    """What one Dynamo run of a workload hit, in the order it happened."""

    timeline: list[BreakEvent | Fragment | RecompileEvent]
    outputs: Any
    optimized: Callable  # the same compiled function, to run again for timing
    timer: FragmentTimer

    @property
    def fragments(self) -> list[Fragment]:
        return [e for e in self.timeline if isinstance(e, Fragment)]

    @property
    def breaks(self) -> list[BreakEvent]:
        return [e for e in self.timeline if isinstance(e, BreakEvent)]

    @property
    def recompiles(self) -> list[RecompileEvent]:
        return [e for e in self.timeline if isinstance(e, RecompileEvent)]


def capture_with_dynamo(fn: Callable, workload: Workload, config: dict | None = None) -> DynamoCapture:
    """Run `workload(optimized_fn)` once under Dynamo with `config` patched into
    `torch._dynamo.config`; record the breaks, fragments and recompiles it causes.

    Dynamo's caches are reset first (as `torch._dynamo.explain` does), so the record is what a
    fresh process would hit.
    """
    torch._dynamo.reset()
    recorder = _Recorder()
    optimized = torch._dynamo.optimize(recorder.backend)(fn)
    with recorder.hooks(), torch._dynamo.config.patch(config or {}):
        outputs = workload(optimized)
    return DynamoCapture(recorder.timeline, outputs, _with_config(optimized, config), recorder.timer)


def _with_config(optimized: Callable, config: dict | None) -> Callable:
    """`optimized` running under the config it was captured with (reordered prints need it)."""
    if not config:
        return optimized

    @functools.wraps(optimized)
    def run(*args, **kwargs):
        with torch._dynamo.config.patch(config or {}):
            return optimized(*args, **kwargs)

    return run


class _Recorder:
    """The hooks of one capture and what they recorded."""

    def __init__(self) -> None:
        self.timeline: list[BreakEvent | Fragment | RecompileEvent] = []
        self.timer = FragmentTimer()
        self._seen_exceptions: set[int] = set()

    def _add(self, event):
        event.order = len(self.timeline)
        self.timeline.append(event)

    def backend(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        reason = getattr(gm, "compile_subgraph_reason", None)
        fragment = Fragment(
            index=sum(isinstance(e, Fragment) for e in self.timeline),
            ops=[op_name(node) for node in gm.graph.nodes if node.op.startswith("call_")],
            reason=reason.reason if reason else "",
            ended_by_break=bool(reason and reason.graph_break),
            stack=source_frames(reason.user_stack if reason else []),
        )
        self._add(fragment)
        return _timed(gm.forward, fragment.index, self.timer)

    def record_break(self, exc: BaseException, message: str, skipped_frame: bool, code=None) -> None:
        if id(exc) in self._seen_exceptions:
            return
        self._seen_exceptions.add(id(exc))
        stack = source_frames(getattr(exc, "real_stack", None) or [])
        if not stack and code is not None:  # refused before tracing began: the frame itself is the place
            stack = [SourceFrame(code.co_filename, code.co_firstlineno, _RESUME_NAME.sub(r"\1", code.co_name))]
        gb_type = getattr(exc, "gb_type", None) or type(exc).__name__
        self._add(BreakEvent(gb_type, message, stack, skipped_frame))

    def record_recompile(self, code, reasons: list[str]) -> None:
        function = _RESUME_NAME.sub(r"\1", code.co_name)
        self._add(RecompileEvent(function, code.co_filename, code.co_firstlineno, list(reasons)))

    @contextmanager
    def hooks(self):
        with ExitStack() as stack:
            stack.enter_context(self._hook_log_graph_break())
            stack.enter_context(self._hook_frame_skips())
            stack.enter_context(self._hook_recompiles())
            yield

    @contextmanager
    def _hook_log_graph_break(self):
        from torch._dynamo.symbolic_convert import InstructionTranslatorBase

        original = InstructionTranslatorBase.log_graph_break
        recorder = self

        def log_graph_break(translator, code_options, reason, exc):
            if not getattr(exc, "logged", False):
                recorder.record_break(exc, reason, skipped_frame=reason.startswith("Failed to handle graph break"))
            return original(translator, code_options, reason, exc)

        InstructionTranslatorBase.log_graph_break = log_graph_break
        try:
            yield
        finally:
            InstructionTranslatorBase.log_graph_break = original

    @contextmanager
    def _hook_frame_skips(self):
        from torch._dynamo import convert_frame
        from torch._dynamo.exc import Unsupported, UserError

        original = convert_frame.format_error_msg
        recorder = self

        def format_error_msg(exc, code, *args, **kwargs):
            if isinstance(exc, (Unsupported, UserError)) and not getattr(exc, "logged", False):
                recorder.record_break(exc, str(exc), skipped_frame=True, code=code)
            return original(exc, code, *args, **kwargs)

        convert_frame.format_error_msg = format_error_msg
        try:
            yield
        finally:
            convert_frame.format_error_msg = original

    @contextmanager
    def _hook_recompiles(self):
        from torch._dynamo import convert_frame

        original = convert_frame.get_and_maybe_log_recompilation_reasons
        recorder = self

        def recompilation_reasons(cache_entries, frame, *args, **kwargs):
            reasons = original(cache_entries, frame, *args, **kwargs)
            recorder.record_recompile(frame.f_code, reasons)
            return reasons

        convert_frame.get_and_maybe_log_recompilation_reasons = recompilation_reasons
        try:
            yield
        finally:
            convert_frame.get_and_maybe_log_recompilation_reasons = original


def _timed(run: Callable, index: int, timer: FragmentTimer) -> Callable:
    def timed(*args):
        if not timer.active:
            return run(*args)
        start = time.perf_counter()
        out = run(*args)
        timer.spans.append((index, start, time.perf_counter()))
        return out

    return timed


def source_frames(stack) -> list[SourceFrame]:
    """Dynamo's FrameSummary list as SourceFrames, resume functions named after their originals."""
    return [SourceFrame(f.filename, f.lineno or 0, _RESUME_NAME.sub(r"\1", f.name)) for f in stack]


def op_name(node: torch.fx.Node) -> str:
    """A short readable name for a graph call: `linear`, `add`, `Tensor.view`, `lm_head`."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return str(target).split(".")[-1] if not str(target)[-1:].isdigit() else str(target)
    name = getattr(target, "__name__", None) or str(target)
    return name.removeprefix("aten.")


@dataclass
class FoundBreak:
    """One distinct break: Dynamo's events at one place for one reason, merged."""

    gb_type: str
    message: str
    stack: list[SourceFrame]
    occurrences: int = 1
    skipped_frame: bool = False
    graph_reason: str = ""  # Dynamo's reason for ending the graph here ("generic_jump TensorVariable()")
    graphs_in: list[int] = field(default_factory=list)  # graphs that ran into this break
    graphs_out: list[int] = field(default_factory=list)  # graphs that ran after it
    ended_graphs: list[int] = field(default_factory=list)  # graphs Dynamo ended here
    unresumable: bool = False  # Dynamo could not resume here and fell back to its last safe point
    gap_owner: int = -1  # the graph after which this break's Python first ran (-1: before any graph)

    @property
    def where(self) -> SourceFrame | None:
        return self.stack[-1] if self.stack else None

    @property
    def fragment_before(self) -> int | None:
        return self.graphs_in[0] if self.graphs_in else None

    @property
    def fragment_after(self) -> int | None:
        return self.graphs_out[0] if self.graphs_out else None


def distinct_breaks(capture: DynamoCapture) -> list[FoundBreak]:
    """The capture's breaks, one per (place, gb_type), each linked to the graphs around it.

    Dynamo logs a break before it compiles the graph the break ended (that graph's reason names
    the same place); the graph compiled next runs after the break. A break met between two
    graphs without ending one (a frame Dynamo skipped) sits between those two graphs.
    """
    found: dict[tuple, FoundBreak] = {}
    pending: list[FoundBreak] = []  # met since the last graph
    awaiting: list[FoundBreak] = []  # the break that ended the last graph
    last = -1
    for event in capture.timeline:
        if isinstance(event, BreakEvent):
            key = (_place(event.stack), event.gb_type)
            if key in found:
                found[key].occurrences += 1
                found[key].skipped_frame |= event.skipped_frame
            else:
                found[key] = FoundBreak(
                    event.gb_type, event.message, event.stack, skipped_frame=event.skipped_frame, gap_owner=last
                )
            found[key].unresumable |= event.message.startswith(_CANNOT_RESUME)
            pending.append(found[key])
        elif isinstance(event, Fragment):
            ended = _break_that_ended(event, pending, found, last) if event.ended_by_break else None
            between = [b for b in pending if b is not ended]
            for b in between:
                _link(b.graphs_in, last)
            for b in awaiting + between:
                _link(b.graphs_out, event.index)
            if ended is not None:
                _link(ended.graphs_in, event.index)
            awaiting, pending, last = ([ended] if ended is not None else []), [], event.index
    for b in pending:
        _link(b.graphs_in, last)
    return list(found.values())


def _link(graphs: list[int], index: int) -> None:
    if index >= 0 and index not in graphs:
        graphs.append(index)


def _place(stack: list[SourceFrame]) -> tuple[str, int]:
    return (stack[-1].filename, stack[-1].lineno) if stack else ("", 0)


def _break_that_ended(fragment: Fragment, pending: list[FoundBreak], found: dict, last: int) -> FoundBreak:
    """The break met at the place where `fragment` ended, or a new one from the graph's reason."""
    place = _place(fragment.stack)
    match = next((b for b in reversed(pending) if place in {(f.filename, f.lineno) for f in b.stack}), None)
    if match is None and fragment.reason == "step_unsupported":  # compiled up to the last safe point
        match = next((b for b in reversed(pending) if b.unresumable), None)
    if match is None:
        gb_type = fragment.reason.splitlines()[0] if fragment.reason else "graph break"
        match = found.setdefault((place, gb_type), FoundBreak(gb_type, fragment.reason, fragment.stack, gap_owner=last))
    match.graph_reason = match.graph_reason or fragment.reason.splitlines()[0]
    if not match.graphs_in:
        match.gap_owner = fragment.index
    _link(match.ended_graphs, fragment.index)
    return match
