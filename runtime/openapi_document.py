"""The server's OpenAPI document: the request and response models of the generation endpoints.

The generation endpoints take the raw Request (so parse_body can answer every bad body in OpenAI's
error shape), which leaves FastAPI nothing to describe; the request and response models are
declared here instead, for GET /openapi.json only: parsing and validation stay in parse_body.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel

from kiln.runtime import openai_protocol as api

OPENAPI_MODELS = (
    (api.CompletionRequest, "validation"),
    (api.ChatCompletionRequest, "validation"),
    (api.CompletionResponse, "serialization"),
    (api.ChatCompletionResponse, "serialization"),
    (api.ChatCompletionChunk, "serialization"),
    (api.ModelList, "serialization"),
    (api.ModelCard, "serialization"),
)
SCHEMA_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": SCHEMA_REF.format(model=model.__name__)}


def operation(request: type[BaseModel] | None, response: type[BaseModel], chunk: type[BaseModel] | None = None) -> dict:
    """An operation's OpenAPI additions: the JSON request body and the 200 answer (streamed as
    server-sent events of `chunk`, or of `response` again, when the request has stream=true)."""
    content = {"application/json": {"schema": _ref(response)}}
    if request is not None:
        content["text/event-stream"] = {
            "schema": {
                "type": "string",
                "description": (
                    f"with stream=true: `data: <{(chunk or response).__name__} JSON>` events, then `data: [DONE]`"
                ),
            }
        }
    extra = {"responses": {"200": {"description": "Successful Response", "content": content}}}
    if request is not None:  # the generation endpoints: errors are OpenAI error objects
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    return extra


def openapi_document(app: FastAPI):
    """app.openapi: FastAPI's document with the request/response models added as components."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model, mode in OPENAPI_MODELS:
                schema = model.model_json_schema(ref_template=SCHEMA_REF, mode=mode)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    return openapi
