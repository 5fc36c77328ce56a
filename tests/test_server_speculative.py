"""`kiln serve --speculative prompt_lookup`: every request drafts by prompt lookup inside the
engine, and greedy answers stay identical to plain decoding; constrained requests decode
without drafts. `kiln serve` with the option and $KILN_API_KEY, end to end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

import kiln
from kiln.ir.errors import ArtifactError
from kiln.runtime.errors import GenerationError
from kiln.runtime.server import create_app
from served import record_submits, served, sigint_default, tiny_llama_artifact

MODEL = "tiny-llama"
# repetitive: its own n-grams come back, so lookup finds drafts
PROMPT = "The capital of France is Paris. The capital of France is Paris. The capital of France is"


@pytest.fixture(scope="module")
def artifact(tiny_model_dirs, tmp_path_factory):
    return tiny_llama_artifact(tiny_model_dirs, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(artifact):
    return kiln.load(artifact)


@pytest.fixture(scope="module")
def client(llm):
    with served(create_app(llm, MODEL, speculative="prompt_lookup")) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def submitted(llm, monkeypatch):
    """The handles of every request the server submits from now on."""
    return record_submits(llm, monkeypatch)


def test_greedy_answers_are_identical_and_drafted(client, llm, submitted):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    plain = llm.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    assert response.choices[0].text == plain.text
    stats = submitted[0].result().stats
    assert stats.drafted_tokens > 0 and stats.target_steps > 0
    chat = [{"role": "user", "content": PROMPT}]
    answer = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=30, temperature=0)
    assert answer.choices[0].message.content == llm.chat(chat, max_new_tokens=30).text


def test_sampled_and_constrained_requests_still_work(client, llm, submitted):
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=4, n=2)
    assert len(sampled.choices) == 2 and all(choice.text for choice in sampled.choices)
    assert submitted[0].result().stats.target_steps > 0  # sampled requests draft too
    constrained = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"choices": ["Paris", "Rome"]}
    )
    assert constrained.choices[0].text == llm.generate(PROMPT, max_new_tokens=12, choices=["Paris", "Rome"]).text
    assert submitted[-1].result().stats.drafted_tokens == 0  # a grammar's forced tokens need no drafts


def test_submit_takes_prompt_lookup_or_heads(llm):
    assert (
        llm.submit(PROMPT, max_new_tokens=8, speculative="prompt_lookup").result().text
        == llm.generate(PROMPT, max_new_tokens=8).text
    )
    with pytest.raises(GenerationError, match="prompt lookup or heads only"):
        llm.submit(PROMPT, speculative="draft.kiln")
    with pytest.raises(ArtifactError, match="has no draft heads. Fix: `kiln train-speculator"):
        llm.submit(PROMPT, speculative="heads")  # the heads are loaded at the call
    with pytest.raises(GenerationError, match="does not take"):
        llm.submit(PROMPT, speculative="prompt_lookup", regex="[a-z]+")


def http(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_kiln_serve_with_speculative_and_an_api_key_from_the_environment(artifact, llm):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kiln",
            "serve",
            str(artifact),
            "--port",
            str(port),
            "--speculative",
            "prompt_lookup",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "KILN_API_KEY": "sk-env"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_default,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http(f"{url}/health")[0] == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
            time.sleep(0.2)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0}
        assert http(f"{url}/v1/completions", body)[0] == 401
        status, answer = http(f"{url}/v1/completions", body, key="sk-env")
        assert status == 200, answer
        assert answer["choices"][0]["text"] == llm.generate(PROMPT, max_new_tokens=20).text
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=60)
    assert server.returncode == 0
