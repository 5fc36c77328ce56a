"""The OpenAI-compatible server, driven by the official `openai` client over a loopback port.

One tiny random Llama artifact (max_batch 4, so concurrent requests share the engine's KV rows)
is served by uvicorn in a thread for the whole module; each answer is checked against the same
request run directly through `LLM.generate`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import kiln
from kiln.runtime.server import create_app
from served import http, http_with_headers, served, tiny_llama_artifact

MODEL = "tiny-llama"
MAX_SEQ_LEN = 128  # tiny_llama_artifact's context
MAX_BODY = 64 * 1024
PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "A compiler translates",
    "In the winter snow",
    "The quick brown fox",
    "Questions and answers:",
    "Tensors are arrays",
    "Peter Piper picked",
]


@pytest.fixture(scope="module")
def artifact(tiny_model_dirs, tmp_path_factory):
    return tiny_llama_artifact(tiny_model_dirs, tmp_path_factory)


@pytest.fixture(scope="module")
def llm(artifact):
    return kiln.load(artifact)


@pytest.fixture(scope="module")
def base_url(llm):
    with served(create_app(llm, MODEL, max_body_bytes=MAX_BODY)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def alone(llm, prompt, max_tokens, **kwargs):
    return llm.generate(prompt, max_new_tokens=max_tokens, **kwargs)


def test_completion_equals_the_same_request_run_directly(client, llm):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    expected = alone(llm, PROMPTS[0], 12)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert response.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPTS[0]))
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_completion_applies_the_chat_template(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    expected = llm.chat(messages, max_new_tokens=10)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(llm.encode_chat(messages))


def test_extra_sampling_fields_and_seed_reproduce_direct_sampling(client, llm):
    settings = dict(
        temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"5": 2.0}
    )
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=10, **settings, extra_body={"top_k": 20, "min_p": 0.05}
    )
    expected = alone(
        llm,
        PROMPTS[1],
        10,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={5: 2.0},
        top_k=20,
        min_p=0.05,
    )
    assert response.choices[0].text == expected.text


def test_stop_strings_and_logprobs(client, llm):
    full = alone(llm, PROMPTS[2], 16).text
    stop = full[3:5]
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop], logprobs=2
    )
    assert response.choices[0].text == alone(llm, PROMPTS[2], 16, stop=[stop]).text
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens
    assert all(
        len(top) <= 2 and max(top.values()) >= lp - 1e-6
        for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs)
    )


def test_streamed_completion_pieces_add_up_to_the_text_and_end_with_usage(client, llm):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[3],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    expected = alone(llm, PROMPTS[3], 20)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_streamed_chat_sends_role_then_content_deltas(client, llm):
    messages = [{"role": "user", "content": "Tell me a story."}]
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == llm.chat(messages, max_new_tokens=15).text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_concurrent_requests_each_equal_the_request_run_alone(client, llm):
    expected = [alone(llm, p, 24, ignore_eos=True).text for p in PROMPTS]

    def ask(i):
        if i % 2:
            stream = client.completions.create(
                model=MODEL,
                prompt=PROMPTS[i],
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join(c.choices[0].text for c in stream)
        return (
            client.completions.create(
                model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(ask, range(len(PROMPTS)))) == expected


def test_models_health_and_metrics(client, base_url, llm):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = http("GET", f"{base_url}/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=4, temperature=0)
    text = http("GET", f"{base_url}/metrics")[1].decode()
    for name in (
        "kiln_requests_total",
        "kiln_prompt_tokens_total",
        "kiln_generation_tokens_total",
        "kiln_time_to_first_token_seconds_bucket",
        "kiln_inter_token_latency_seconds_bucket",
        "kiln_queue_depth",
        "kiln_kv_slots_in_use",
        "kiln_kv_slots_total 4.0",
    ):
        assert name in text


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


def test_prompt_longer_than_the_context_is_400_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[7] * (MAX_SEQ_LEN + 1), max_tokens=2)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert caught.value.body["param"] == "prompt"


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_p=0), "top_p"),
        (dict(logit_bias={"999999": 1}), "logit_bias"),
        (dict(extra_body={"bogus": 1}), "bogus"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(client, bad, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **bad)
    assert caught.value.body["param"] == param
    assert caught.value.body["type"] == "invalid_request_error"


def test_chat_message_carries_a_null_refusal(base_url):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    status, answer = http("POST", f"{base_url}/v1/chat/completions", body)
    assert status == 200
    message = json.loads(answer)["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None


@pytest.mark.parametrize(
    "field, value",
    [("temperature", "0.5"), ("stream", "yes"), ("max_tokens", "4"), ("ignore_eos", 1), ("top_p", True), ("seed", 1.0)],
)
def test_values_of_the_wrong_json_type_are_400(base_url, field, value):
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}
    ).encode()
    status, answer = http("POST", f"{base_url}/v1/chat/completions", body)
    assert status == 400, answer
    assert json.loads(answer)["error"]["param"] == field


def test_an_int_fills_a_float_and_fields_clients_send_are_ignored(client, llm):
    messages = [{"role": "user", "content": "Where is Paris?"}]
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        top_p=1,
        presence_penalty=0,
        extra_body={"store": False, "metadata": {"user": "x"}, "service_tier": "auto", "parallel_tool_calls": True},
    )
    assert response.choices[0].message.content == llm.chat(messages, max_new_tokens=6).text
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=0,
        extra_body={"store": True, "service_tier": "default"},
    )
    assert completion.choices[0].text == alone(llm, PROMPTS[0], 4).text


def test_openapi_document_describes_the_real_request_and_response_bodies(base_url):
    status, body = http("GET", f"{base_url}/openapi.json")
    assert status == 200
    document = json.loads(body)
    schemas = document["components"]["schemas"]

    def resolve(schema: dict) -> dict:
        return schemas[schema["$ref"].rsplit("/", 1)[-1]] if "$ref" in schema else schema

    for path, request, response in (
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
    ):
        operation = document["paths"][path]["post"]
        assert operation["requestBody"]["required"] is True
        assert resolve(operation["requestBody"]["content"]["application/json"]["schema"]) is schemas[request]
        assert resolve(operation["responses"]["200"]["content"]["application/json"]["schema"]) is schemas[response]
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["properties"]["temperature"]["maximum"] == 2.0 and "top_k" in chat["properties"]
    assert chat["additionalProperties"] is False
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "refusal" in schemas["AssistantMessage"]["properties"]
    refs = re.findall(r'"\$ref": ?"#/components/schemas/([^"]+)"', body.decode())
    assert refs and all(name in schemas for name in refs)
    assert http("GET", f"{base_url}/docs")[0] == 404  # the document only; no interactive docs page


def test_malformed_json_is_400_and_oversized_body_is_413(base_url):
    status, body = http("POST", f"{base_url}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, body = http(
        "POST", f"{base_url}/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY}).encode()
    )
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


def test_a_wrong_method_is_405_with_an_allow_header(base_url):
    status, headers, body = http_with_headers("GET", f"{base_url}/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    status, headers, _ = http_with_headers("POST", f"{base_url}/v1/models", b"{}")
    assert status == 405 and "GET" in headers["allow"]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_post_that_is_not_application_json_is_415(base_url, content_type):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    status, _, answer = http_with_headers("POST", f"{base_url}/v1/completions", body, {"content-type": content_type})
    assert status == 415
    error = json.loads(answer)["error"]
    assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"
    assert content_type in error["message"] and "Fix:" in error["message"]
    status, _, answer = http_with_headers(
        "POST", f"{base_url}/v1/completions", body, {"content-type": "application/json; charset=utf-8"}
    )
    assert status == 200, answer


def test_no_cors_headers_are_sent(base_url):
    origin = {"origin": "https://elsewhere.example"}
    preflight = {**origin, "access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    status, headers, _ = http_with_headers("OPTIONS", f"{base_url}/v1/chat/completions", None, preflight)
    assert status == 405 and "access-control-allow-origin" not in headers
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    for method, path, data in (("GET", "/v1/models", None), ("POST", "/v1/completions", body)):
        status, headers, _ = http_with_headers(method, f"{base_url}{path}", data, origin)
        assert status == 200 and not any(name.lower().startswith("access-control-") for name in headers)


def test_allowed_hosts_refuse_other_host_headers(llm):
    from fastapi.testclient import TestClient

    from kiln.runtime.server import default_allowed_hosts

    app = create_app(llm, MODEL, allowed_hosts=default_allowed_hosts("10.1.2.3"))
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1234", "[::1]:8000", "10.1.2.3:8000"):
            assert client.get("/health", headers={"host": host}).status_code == 200, host
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.2", ""):
            response = client.get("/health", headers={"host": host})
            assert response.status_code == 400, host
            assert response.json()["error"]["code"] == "invalid_host"
        response = client.post("/v1/completions", headers={"host": "evil.example"}, json={"model": MODEL})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host"
    with TestClient(create_app(llm, MODEL, allowed_hosts=["*"])) as client:
        assert client.get("/health", headers={"host": "anything.example"}).status_code == 200
    with TestClient(create_app(llm, MODEL)) as client:  # None: any host, as before
        assert client.get("/health", headers={"host": "anything.example"}).status_code == 200


def test_full_queue_is_429_and_the_server_keeps_serving(client, llm):
    bound = llm.engine.max_queue
    llm.engine.max_queue = 0
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert caught.value.body["code"] == "queue_full"
        assert caught.value.response.headers["retry-after"] == "1"
    finally:
        llm.engine.max_queue = bound
    assert (
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).choices[0].text
        == alone(llm, "hi", 2).text
    )


def test_client_disconnecting_mid_stream_cancels_its_request_and_frees_its_slot(client, base_url, llm, monkeypatch):
    handles = []
    submit = llm.submit

    def recording_submit(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    monkeypatch.setattr(llm, "submit", recording_submit)
    stream = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=MAX_SEQ_LEN, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    result = handles[0].result(timeout=30)
    assert result.finish_reason == "cancelled"
    assert len(result.token_ids) < MAX_SEQ_LEN - 2
    deadline = time.monotonic() + 10
    while llm.engine.slots_in_use:
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.01)
    assert "kiln_kv_slots_in_use 0.0" in http("GET", f"{base_url}/metrics")[1].decode()


def test_serve_without_fastapi_says_what_to_install():
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from kiln.cli import kiln_main; sys.exit(kiln_main(['serve', 'model.kiln']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert "pip install 'kiln[serve]'" in done.stderr


def test_response_format_json_schema_constrains_the_output(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"enum": ["small", "large"]}},
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}},
    )
    import jsonschema

    jsonschema.validate(json.loads(response.choices[0].message.content), schema)


def test_choices_and_malformed_response_format(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, extra_body={"choices": ["Paris", "Rome"]}
    )
    assert response.choices[0].text in ("Paris", "Rome")
    with pytest.raises(openai.BadRequestError, match="json_schema.schema"):
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=8,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        )
