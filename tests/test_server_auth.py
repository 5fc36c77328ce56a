"""`kiln serve --api-key KEY` (or $KILN_API_KEY): every endpoint but /health needs
`Authorization: Bearer KEY`; a missing or wrong key is a 401 in OpenAI's error shape, which the
`openai` client raises as AuthenticationError."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

import kiln
from kiln.cli import kiln_main
from kiln.runtime.server import create_app
from served import served, tiny_llama_artifact

MODEL = "tiny-llama"
KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def llm(tiny_model_dirs, tmp_path_factory):
    return kiln.load(tiny_llama_artifact(tiny_model_dirs, tmp_path_factory))


@pytest.fixture(scope="module")
def base_url(llm):
    with served(create_app(llm, MODEL, api_key=KEY)) as url:
        yield url


def client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_the_right_key_is_served(base_url, llm):
    response = client(base_url, KEY).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert response.choices[0].text == llm.generate("Once upon a time", max_new_tokens=5).text
    assert [m.id for m in client(base_url, KEY).models.list().data] == [MODEL]


def test_a_wrong_key_is_a_401_in_openai_s_error_shape(base_url):
    with pytest.raises(openai.AuthenticationError) as caught:
        client(base_url, KEY + "x").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    assert caught.value.status_code == 401
    error = caught.value.body
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["param"] is None
    assert "not this server's" in error["message"] and "Fix:" in error["message"]
    with pytest.raises(openai.AuthenticationError):
        client(base_url, KEY[:-1]).models.list()  # a prefix of the key is no key


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/openapi.json", "/v1/models/tiny-llama"])
def test_every_endpoint_but_health_needs_the_key(base_url, path):
    status, headers, body = get(base_url + path)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(body)["error"]["message"].startswith("No API key was given")
    assert get(base_url + path, {"Authorization": "Basic " + KEY})[0] == 401
    assert get(base_url + path, {"Authorization": "bearer " + KEY})[0] == 200  # the scheme in any case
    status, _, body = get(base_url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


@pytest.mark.parametrize("key, env", [("", None), ("two words", None), ("clé", None), (None, "has space")])
def test_a_key_no_header_can_carry_is_refused_at_start(monkeypatch, capsys, key, env):
    if env is None:
        monkeypatch.delenv("KILN_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KILN_API_KEY", env)
    argv = ["serve", "no-such.kiln"] + (["--api-key", key] if key is not None else [])
    assert kiln_main(argv) == 2
    err = capsys.readouterr().err
    assert ("--api-key" if key is not None else "$KILN_API_KEY") in err and "Fix:" in err
