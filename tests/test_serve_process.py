"""`kiln serve` and loading as whole processes: Ctrl-C, a port already taken, a killed process,
an artifact the server cannot take."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import kiln
from served import http, http_with_headers, sigint_default, tiny_llama_artifact

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def artifact(tiny_model_dirs, tmp_path_factory):
    return tiny_llama_artifact(tiny_model_dirs, tmp_path_factory)


def test_a_killed_process_leaves_no_unpacked_aoti_package_behind(tiny_model_dirs, tmp_path, monkeypatch):
    """Loading an inductor artifact unpacks its AOTInductor package under $TMPDIR; Kiln removes
    that as soon as the load is done, so a server killed outright (no atexit, no destructor)
    leaves nothing there."""
    monkeypatch.setenv("KILN_LINEAR_KERNEL", "torch")  # keeps Kiln's own C++ kernels out of the build
    monkeypatch.setenv("KILN_ATTENTION_KERNEL", "torch")
    artifact = kiln.compile(
        str(tiny_model_dirs("llama")), out=tmp_path / "aoti.kiln", backend="inductor", max_seq_len=32, max_batch=1
    )
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code = (
        "import os, signal, sys, kiln\n"
        f"llm = kiln.load({str(artifact)!r})\n"
        "unpacked = [p for p in os.listdir(sys.argv[1]) if 'aoti' in p]\n"
        "print(unpacked, len(llm.generate('Once', max_new_tokens=2).token_ids), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(scratch)],
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.strip() == "[] 2", done.stdout + done.stderr
    assert not [p for p in scratch.rglob("*") if "aoti" in p.name]


def test_serve_refuses_a_tensor_parallel_artifact(tmp_path, capsys):
    from kiln.cli import kiln_main

    (tmp_path / "manifest.json").write_text(json.dumps({"tensor_parallel": 2}))
    assert kiln_main(["serve", str(tmp_path)]) == 2
    assert "sharded over 2 ranks" in capsys.readouterr().err


def test_kiln_serve_runs_the_engine_in_the_main_thread_and_stops_on_ctrl_c(artifact):
    """`kiln serve` answers from a model whose calls run in the main thread (uvicorn in another),
    and Ctrl-C (SIGINT) stops both; a port already taken is a one-line error."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import sys, threading, kiln.runtime.engine as e\n"
        "run = e.Engine.run_in_this_thread\n"
        "def checked(self, stop):\n"
        "    assert threading.current_thread() is threading.main_thread()\n"
        "    print('engine in main thread', flush=True)\n"
        "    run(self, stop)\n"
        "e.Engine.run_in_this_thread = checked\n"
        "from kiln.cli import kiln_main\n"
        f"sys.exit(kiln_main(['serve', {str(artifact)!r}, '--port', '{port}', '--log-level', 'warning']))"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http("GET", f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
            time.sleep(0.1)
        name = json.loads(http("GET", f"http://127.0.0.1:{port}/v1/models")[1])["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
        status, answer = http("POST", f"http://127.0.0.1:{port}/v1/completions", body)
        assert status == 200, answer
        assert json.loads(answer)["choices"][0]["text"] == kiln.load(artifact).generate(PROMPT, max_new_tokens=4).text
        assert (
            http_with_headers("GET", f"http://127.0.0.1:{port}/health", None, {"host": f"localhost:{port}"})[0] == 200
        )
        status, _, answer = http_with_headers(
            "GET", f"http://127.0.0.1:{port}/health", None, {"host": f"rebound.example:{port}"}
        )
        assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_host"
        taken = subprocess.run(
            [sys.executable, "-m", "kiln", "serve", str(artifact), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert taken.returncode != 0 and "did not start" in taken.stderr
    finally:
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    assert "engine in main thread" in out
