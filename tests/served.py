"""Serving an app on a loopback port for the `openai` client: uvicorn in a daemon thread."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import urllib.error
import urllib.request

import uvicorn

import kiln

_ARTIFACTS: dict = {}


def tiny_llama_artifact(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama compiled once per session for the server tests (reference backend, context
    128, max_batch 4: concurrent requests share the KV rows); each module loads its own LLM."""
    if "llama" not in _ARTIFACTS:
        _ARTIFACTS["llama"] = kiln.compile(
            str(tiny_model_dirs("llama")),
            out=tmp_path_factory.mktemp("served") / "tiny-llama.kiln",
            backend="reference",
            max_seq_len=128,
            max_batch=4,
        )
    return _ARTIFACTS["llama"]


@contextlib.contextmanager
def served(app):
    """The app served on a free loopback port; yields its base URL (http://127.0.0.1:PORT)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def record_submits(llm, monkeypatch) -> list:
    """The handles of every request `llm.submit` makes from now on (what the server submits)."""
    handles, submit = [], llm.submit

    def recording(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(llm, "submit", recording)
    return handles


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of a plain HTTP request, errors included."""
    status, _, answer = http_with_headers(method, url, body)
    return status, answer


def http_with_headers(method: str, url: str, body: bytes | None = None, headers: dict | None = None):
    """(status, response headers, body) of a plain HTTP request, errors included."""
    request = urllib.request.Request(
        url, data=body, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def sigint_default() -> None:
    """A server child's preexec_fn: SIGINT at its default, so Python installs its Ctrl-C handler
    there even when the suite itself runs as a background job, whose shell ignores SIGINT (an
    ignored signal is inherited across exec, and Python then leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
