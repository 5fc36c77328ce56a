"""An ASGI middleware that answers only the Host names a server was told to: any other `Host`
header is a 400 in OpenAI's error shape, before the body is read. A web page on another name
that resolves to a loopback server (DNS rebinding) then reaches nothing.
"""

from __future__ import annotations

from kiln.runtime.openai_errors import APIError


class HostCheck:
    """ASGI middleware: a request whose Host header (port aside) is not in `allowed` gets a 400 in
    OpenAI's error shape ("*" allows any)."""

    def __init__(self, app, allowed: list[str]):
        self.app = app
        self.allowed = {_host_form(host) for host in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if _host_name(host) not in self.allowed:
            error = APIError(
                400,
                f"The Host header {host[:100]!r} is not one this server answers to "
                f"({', '.join(sorted(self.allowed))}). Fix: use one of those names, or start "
                "the server with --allowed-hosts naming this one.",
                "invalid_request_error",
                None,
                "invalid_host",
            )
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """A Host header without its port: "[::1]:8000" -> "[::1]", "Example.com:80" -> "example.com"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.split(":", 1)[0]


def _host_form(host: str) -> str:
    """A host name or address as a Host header names it: lowercase, an IPv6 address in brackets."""
    host = host.strip().lower()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def default_allowed_hosts(host: str) -> list[str]:
    """The hosts `kiln serve` answers by default: the bound address and the loopback names."""
    return [host, "localhost", "127.0.0.1", "[::1]"]
