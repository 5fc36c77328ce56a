"""An ASGI middleware that refuses request bodies over a size limit (413) before any handler runs.

The body is read here, counted as it arrives (a chunked upload has no Content-Length to trust),
kept only up to the limit, and replayed to the app; after the body, `receive` passes through, so handlers still see the
client disconnect.
"""

from __future__ import annotations

import json

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# An oversized body is read on (and dropped) up to this much more, so the client gets to read the
# 413 instead of a reset connection; beyond it the connection is closed.
DRAIN_BYTES = 64 * 1024 * 1024


class BodyLimit:
    """Wrap `app`; bodies over `max_bytes` get a 413 OpenAI-style error."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
            if size > self.max_bytes + DRAIN_BYTES:
                break
        if size > self.max_bytes:
            return await self._refuse(send)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        payload = json.dumps(
            {
                "error": {
                    "message": f"The request body is larger than this server accepts ({self.max_bytes} bytes). "
                    "Fix: send a shorter prompt, or start the server with a larger --max-body-bytes.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
