"""Server-sent events for streamed completions: `data: {json}` events, then `data: [DONE]`.

The stream owns its request: when it ends for any reason (done, an error, or the client going
away, which cancels the response task) the request is cancelled, so a client that disconnects
mid-stream frees its KV slot at the engine's next step. An error after the first event can no
longer change the status, so it is sent as an OpenAI error object event before [DONE].
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.responses import StreamingResponse

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: BaseModel | dict) -> bytes:
    """One SSE event carrying `payload` as JSON."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + data.encode() + b"\n\n"


def event_stream(events: AsyncIterator[bytes], handle, on_error) -> StreamingResponse:
    """A text/event-stream response of `events`, ending with [DONE]; `handle` is cancelled when the
    response ends. `on_error(exception)` logs a failure mid-stream and gives its error object."""

    async def body():
        try:
            async for chunk in events:
                yield chunk
        except Exception as error:  # noqa: BLE001 - reported to the client, the server goes on
            yield event(on_error(error).body())
        yield DONE

    return _CancellingStream(body(), handle)


class _CancellingStream(StreamingResponse):
    """A StreamingResponse that cancels its request however the response ends (on a client
    disconnect Starlette cancels the sending task, so the body generator may never resume)."""

    def __init__(self, body, handle):
        super().__init__(body, media_type="text/event-stream", headers=HEADERS)
        self.handle = handle

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()  # a no-op once the request is done
