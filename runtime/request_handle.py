"""`RequestHandle`: one request submitted to the engine, read from any thread or event loop.

The engine thread posts events (a text piece, the final result, or an error) into the handle's
queue; the consumer iterates pieces synchronously (`for piece in handle`) or from asyncio
(`async for piece in handle`), and takes the `GenerationResult` with `result()` / `await wait()`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

from kiln.runtime.results import GenerationResult

_PIECE, _DONE, _ERROR = "piece", "done", "error"


class RequestHandle:
    """A submitted request: its text as it comes, then its result."""

    def __init__(self, request_id: int, sink: queue.SimpleQueue | None = None, tag: Any = None):
        self.id = request_id
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._sink, self._tag = sink, tag  # a shared queue that also gets (tag, kind, payload)
        self._finished = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []  # async consumers

    # -- the engine's side ---------------------------------------------------------------
    def post_piece(self, piece: str) -> None:
        self._post(_PIECE, piece)

    def post_result(self, result: GenerationResult) -> None:
        self._result = result
        self._finished.set()
        self._post(_DONE, result)

    def post_error(self, error: BaseException) -> None:
        self._error = error
        self._finished.set()
        self._post(_ERROR, error)

    def _post(self, kind: str, payload) -> None:
        self._events.put((kind, payload))
        if self._sink is not None:
            self._sink.put((self._tag, kind, payload))
        for loop, wake in list(self._wakers):
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # that event loop has closed
                pass

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled.is_set()

    # -- the consumer's side -------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def cancel(self) -> None:
        """Stop generating: the engine frees the request's slot at its next step (finish_reason
        "cancelled"). Harmless once the request is done."""
        self._cancelled.set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the request is done; its result (or the error that ended it)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.id} is not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    async def wait(self) -> GenerationResult:
        """`result()` for asyncio: waits without blocking the event loop."""
        wake = self._waker()
        while True:
            wake.clear()
            if self._finished.is_set():
                return self.result()
            await wake.wait()

    def _waker(self) -> asyncio.Event:
        """An event the engine thread sets (through this loop) whenever it posts."""
        wake = asyncio.Event()
        self._wakers.append((asyncio.get_running_loop(), wake))
        return wake

    def __iter__(self):
        while (piece := _piece(*self._events.get())) is not None:
            yield piece

    async def __aiter__(self):
        wake = self._waker()
        while True:
            wake.clear()  # before looking, so a post after the look still wakes us
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                await wake.wait()
                continue
            if (piece := _piece(*event)) is None:
                return
            yield piece


def _piece(kind: str, payload):
    """An event's text piece; None at the end; raises the error that ended the request."""
    if kind == _ERROR:
        raise payload
    return payload if kind == _PIECE else None
