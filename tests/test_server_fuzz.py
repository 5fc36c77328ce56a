"""Fuzzing the server against its own OpenAPI document: no request is a 5xx.

Schemathesis reads GET /openapi.json and Hypothesis generates bodies for both generation
endpoints, valid ones (positive) and ones that break the schema (negative: wrong types, values
out of bounds, missing fields), a bounded number of each, derandomized so every run sends the
same requests. Every answer must be below 500 (a streamed answer must carry no server_error
event either), and afterwards the server must answer the first greedy request the same way,
with no KV row or queue entry left behind. `model` is pinned to the served name, or nearly
every request would stop at the 404 before reaching the engine.
"""

from __future__ import annotations

import copy

import pytest
from fastapi.testclient import TestClient

from kiln.runtime.server import create_app
from test_generate_loop import tokenizer  # noqa: F401 - a fixture
from test_request_validation import MODEL, greedy, reference_llm

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

CASES_PER_MODE = 40  # per endpoint and mode: 160 requests, about half a minute on the tiny model
REQUEST_MODELS = ("CompletionRequest", "ChatCompletionRequest")


def served_schema(client: TestClient, app):
    """The server's OpenAPI document, `model` pinned to the served name, as a schemathesis schema."""
    response = client.get("/openapi.json")
    assert response.status_code == 200
    document = copy.deepcopy(response.json())
    for name in REQUEST_MODELS:
        document["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    schema = schemathesis.openapi.from_dict(document)
    schema.app = app
    return schema


@pytest.mark.slow
def test_generated_requests_get_no_5xx_and_leave_the_server_as_it_was(tokenizer):  # noqa: F811
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation.modes import GenerationMode

    llm = reference_llm(tokenizer)
    app = create_app(llm, MODEL)
    with TestClient(app, raise_server_exceptions=False) as client:
        first = greedy(client)
        schema = served_schema(client, app)
        answered = []
        for path in ("/v1/completions", "/v1/chat/completions"):
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @settings(
                    max_examples=CASES_PER_MODE,
                    derandomize=True,
                    database=None,
                    deadline=None,
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=schema[path]["POST"].as_strategy(generation_mode=mode))
                def no_server_error(case):
                    response = case.call()
                    answered.append(response.status_code)
                    assert response.status_code < 500, (case.body, response.text[:500])
                    assert '"server_error"' not in response.text, (case.body, response.text[-500:])

                no_server_error()
        assert greedy(client) == first
    assert llm.engine.slots_in_use == 0 and llm.engine.queue_depth == 0
    assert 200 in answered and 400 in answered  # the fuzz reached the engine, and was refused too
