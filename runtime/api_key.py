"""An ASGI middleware that answers only requests carrying the server's API key: every path but
/health needs `Authorization: Bearer KEY` (what the `openai` client sends for `api_key=KEY`);
a missing or wrong key is a 401 in OpenAI's error shape, before the body is read. The key is
compared in constant time, so the time to refuse says nothing about how much of it was right.
"""

from __future__ import annotations

import hmac

from kiln.ir.errors import KilnError
from kiln.runtime.openai_errors import APIError

API_KEY_ENV = "KILN_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # for load balancers' and orchestrators' probes


class ApiKeyCheck:
    """ASGI middleware: requests outside OPEN_PATHS without `Authorization: Bearer <key>` get a 401."""

    def __init__(self, app, key: str):
        self.app = app
        self.key = check_api_key(key).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = _bearer(dict(scope["headers"]).get(b"authorization", b""))
        if given is None or not hmac.compare_digest(given, self.key):
            what = "No API key was given" if given is None else "The API key given is not this server's"
            error = APIError(
                401,
                f"{what}. Fix: send the header Authorization: Bearer <key> (the openai "
                "client: api_key=<key>) with the key the server was started with.",
                "invalid_request_error",
                None,
                "invalid_api_key",
                {"WWW-Authenticate": "Bearer"},
            )
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def check_api_key(key: str) -> str:
    """The key, if it can be sent in a header: KilnError for an empty one or one with spaces or
    characters outside printable ASCII."""
    if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise KilnError(
            "The API key is empty or holds spaces or characters outside printable ASCII, which an "
            "Authorization header cannot carry. Fix: use e.g. the output of `openssl rand -hex 32`."
        )
    return key


def _bearer(header: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme in any case); None if absent."""
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
