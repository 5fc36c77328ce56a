"""An OpenAI-compatible HTTP server over the continuous-batching engine.

    kiln serve model.kiln [--host 127.0.0.1] [--port 8000]
    app = create_app(kiln.load("model.kiln"))          # any ASGI server can run it

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), GET
/v1/models, GET /health, GET /metrics (Prometheus), GET /openapi.json. Streaming uses server-sent events. Each
request is submitted to `llm.submit` and shares the KV slots with every other request in
flight; a full waiting queue answers 429, and a client that goes away cancels its request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
import time
import uuid

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from kiln.ir.errors import KilnError
from kiln.runtime import openai_protocol as api
from kiln.runtime.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from kiln.runtime.errors import ConstraintError
from kiln.runtime.host_check import HostCheck, default_allowed_hosts
from kiln.runtime.openai_errors import (APIError, from_kiln_error, from_validation_error, internal, invalid,
                                        model_not_found)
from kiln.runtime.openai_logprobs import chat_logprobs, completion_logprobs
from kiln.runtime.server_metrics import RequestTimer, ServerMetrics
from kiln.runtime.sse import event, event_stream

log = logging.getLogger(__name__)

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "abort"}
MAX_JSON_DEPTH = 64  # far beyond any real body (a JSON schema's nesting included); bounds the recursions after it
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads makes them from escapes like "\ud800"


def create_app(llm, model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               allowed_hosts: list[str] | None = None) -> FastAPI:
    """The ASGI app serving `llm` (a loaded `kiln.LLM`) under `model_name` (default: the artifact's
    source directory name). `allowed_hosts`: the `Host` header values (port aside) answered; any
    other is a 400, which keeps a web page on another name (DNS rebinding) from reaching a
    loopback server. None answers any host; "*" in the list does too."""
    name = model_name or _default_name(llm)
    created = int(time.time())
    metrics = ServerMetrics(getattr(llm, "engine", None))
    app = FastAPI(title="Kiln", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = _openapi(app)
    app.state.llm, app.state.model_name, app.state.metrics = llm, name, metrics
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)  # added last: runs first, before the body is read
    # No CORS middleware: answers carry no Access-Control-Allow-Origin, so a browser keeps other
    # origins' pages from reading them, and POSTs they could send without a preflight (a "simple"
    # Content-Type) are refused 415 in _parse.
    app.add_exception_handler(APIError, lambda request, error: error.response())
    app.add_exception_handler(HTTPException, lambda request, error: APIError(  # a 405 keeps its Allow header
        error.status_code, str(error.detail), "invalid_request_error", headers=error.headers).response())
    app.add_exception_handler(Exception, _unexpected)

    @app.get("/health")
    async def health():
        engine = getattr(llm, "engine", None)
        return {"status": "ok", "model": name,
                "slots_in_use": engine.slots_in_use if engine else None,
                "queue_depth": engine.queue_depth if engine else None}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=metrics.content_type)

    @app.get("/v1/models", openapi_extra=_operation(None, api.ModelList))
    async def models():
        return _card_list(name, created, llm.max_seq_len).model_dump()

    @app.get("/v1/models/{model_id:path}", openapi_extra=_operation(None, api.ModelCard))
    async def model(model_id: str):
        if model_id != name:
            raise model_not_found(model_id, name)
        return _card_list(name, created, llm.max_seq_len).data[0].model_dump()

    @app.post("/v1/completions", openapi_extra=_operation(api.CompletionRequest, api.CompletionResponse))
    async def completions(request: Request):
        return await _counted(metrics, "completions", lambda request_id: _completion(llm, name, request, metrics,
                                                                                     request_id))

    @app.post("/v1/chat/completions",
              openapi_extra=_operation(api.ChatCompletionRequest, api.ChatCompletionResponse, api.ChatCompletionChunk))
    async def chat_completions(request: Request):
        return await _counted(metrics, "chat", lambda request_id: _chat(llm, name, request, metrics, request_id))

    return app


def _unexpected(request: Request, error: Exception) -> Response:
    """A 500 for an exception outside the generation endpoints (they answer their own), logged."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return internal(error).response()


# -- the OpenAPI document -------------------------------------------------------------------------
# The generation endpoints take the raw Request (so _parse can answer every bad body in OpenAI's
# error shape), which leaves FastAPI nothing to describe; the request and response models are
# declared here instead, for GET /openapi.json only: parsing and validation stay in _parse.
OPENAPI_MODELS = ((api.CompletionRequest, "validation"), (api.ChatCompletionRequest, "validation"),
                  (api.CompletionResponse, "serialization"), (api.ChatCompletionResponse, "serialization"),
                  (api.ChatCompletionChunk, "serialization"), (api.ModelList, "serialization"),
                  (api.ModelCard, "serialization"))
SCHEMA_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": SCHEMA_REF.format(model=model.__name__)}


def _operation(request: type[BaseModel] | None, response: type[BaseModel], chunk: type[BaseModel] | None = None) -> dict:
    """An operation's OpenAPI additions: the JSON request body and the 200 answer (streamed as
    server-sent events of `chunk`, or of `response` again, when the request has stream=true)."""
    content = {"application/json": {"schema": _ref(response)}}
    if request is not None:
        content["text/event-stream"] = {"schema": {"type": "string", "description": (
            f"with stream=true: `data: <{(chunk or response).__name__} JSON>` events, then `data: [DONE]`")}}
    extra = {"responses": {"200": {"description": "Successful Response", "content": content}}}
    if request is not None:  # the generation endpoints: errors are OpenAI error objects
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    return extra


def _openapi(app: FastAPI):
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


# -- the two generation endpoints ----------------------------------------------------------------
async def _completion(llm, name: str, request: Request, metrics: ServerMetrics, request_id: str) -> Response:
    timer = metrics.timer()
    req = await _parse(request, api.CompletionRequest)
    _check_request(req, name)
    if req.echo or req.suffix is not None or req.best_of not in (None, 1):
        param = "echo" if req.echo else "suffix" if req.suffix is not None else "best_of"
        raise invalid(f"{param} is not supported by this server. Fix: leave it out.", param)
    prompt = _single_prompt(req.prompt)
    failed = _on_failure(request_id, _constraint_param(req))
    handle = await _submit(llm, prompt, "prompt", _sampling(llm, req, req.max_tokens, req.logprobs), failed)
    if req.stream:
        return event_stream(_completion_events(handle, req, name, timer), handle, failed)
    result = await _collect(handle, timer, request, failed)
    logprobs = await asyncio.to_thread(completion_logprobs, llm, result) if req.logprobs is not None else None
    choice = api.CompletionChoice(text=result.text, finish_reason=FINISH_REASONS.get(result.finish_reason),
                                  logprobs=logprobs)
    return _json(api.CompletionResponse(model=name, choices=[choice], usage=_usage(result)))


async def _chat(llm, name: str, request: Request, metrics: ServerMetrics, request_id: str) -> Response:
    timer = metrics.timer()
    req = await _parse(request, api.ChatCompletionRequest)
    _check_request(req, name)
    messages = [_template_message(message, index) for index, message in enumerate(req.messages)]
    try:
        prompt = await asyncio.to_thread(llm.encode_chat, messages)
    except KilnError as error:
        raise invalid(str(error), "messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    failed = _on_failure(request_id, _constraint_param(req))
    handle = await _submit(llm, prompt, "messages", _sampling(llm, req, max_tokens, top), failed)
    if req.stream:
        return event_stream(_chat_events(handle, req, name, timer), handle, failed)
    result = await _collect(handle, timer, request, failed)
    logprobs = await asyncio.to_thread(chat_logprobs, llm, result) if req.logprobs else None
    choice = api.ChatChoice(message=api.AssistantMessage(content=result.text),
                            finish_reason=FINISH_REASONS.get(result.finish_reason), logprobs=logprobs)
    return _json(api.ChatCompletionResponse(model=name, choices=[choice], usage=_usage(result)))


def _template_message(message: api.ChatMessage, index: int) -> dict:
    """A chat message as chat templates take it (Hugging Face's convention): tool calls' JSON
    arguments parsed into objects, `developer` as `system`."""
    out = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
            "name": call.function.name, "arguments": _tool_arguments(call.function.arguments,
                                                                     f"messages.{index}.tool_calls.{number}")}}
            for number, call in enumerate(message.tool_calls)]
    return out


def _tool_arguments(arguments: str, param: str) -> dict:
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid(f"{param}.function.arguments is not a JSON object ({arguments!r:.60}). Fix: send the "
                      "call's arguments as the text of a JSON object, e.g. '{\"city\": \"Paris\"}'.",
                      f"{param}.function.arguments", "invalid_value")
    return parsed


async def _completion_events(handle, req: api.CompletionRequest, name: str, timer: RequestTimer):
    base = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name)
    async for piece in handle:
        timer.piece()
        yield event(api.CompletionResponse(**base, choices=[api.CompletionChoice(text=piece)]))
    result = await handle.wait()
    _finished(timer, result)
    yield event(api.CompletionResponse(**base, choices=[api.CompletionChoice(
        text="", finish_reason=FINISH_REASONS.get(result.finish_reason))]))
    if req.stream_options and req.stream_options.include_usage:
        yield event(api.CompletionResponse(**base, choices=[], usage=_usage(result)))


async def _chat_events(handle, req: api.ChatCompletionRequest, name: str, timer: RequestTimer):
    base = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name)

    def chunk(delta: api.Delta, finish_reason=None, usage=None, choices=True):
        listed = [api.ChatChunkChoice(delta=delta, finish_reason=finish_reason)] if choices else []
        return event(api.ChatCompletionChunk(**base, choices=listed, usage=usage))

    yield chunk(api.Delta(role="assistant", content=""))
    async for piece in handle:
        timer.piece()
        yield chunk(api.Delta(content=piece))
    result = await handle.wait()
    _finished(timer, result)
    yield chunk(api.Delta(), FINISH_REASONS.get(result.finish_reason))
    if req.stream_options and req.stream_options.include_usage:
        yield chunk(api.Delta(), usage=_usage(result), choices=False)


# -- request handling ----------------------------------------------------------------------------
async def _counted(metrics: ServerMetrics, endpoint: str, handler) -> Response:
    """Run an endpoint (`handler(request_id)`) under a fresh request id, turning every failure into
    that request's OpenAI error response (a 500 is logged with the id), and count the answer."""
    request_id = f"req_{uuid.uuid4().hex}"
    try:
        response = await handler(request_id)
    except APIError as error:  # a 500 among them was logged where it was made (_on_failure)
        response = error.response()
    except Exception as error:  # noqa: BLE001 - a bug must not take the server down
        response = _on_failure(request_id)(error).response()
    response.headers["x-request-id"] = request_id
    metrics.requests.labels(endpoint, str(response.status_code)).inc()
    return response


def _on_failure(request_id: str, constraint_param: str | None = None):
    """What an exception inside a request becomes, logged with the request's id: a 400 when its
    output constraint cannot be followed (e.g. it needs a character the vocabulary cannot spell,
    found only while generating), otherwise a 500 for that request alone."""

    def failed(error: BaseException) -> APIError:
        if isinstance(error, ConstraintError):
            log.warning("request %s: its constraint failed: %s", request_id, error)
            return invalid(str(error), constraint_param, "invalid_value")
        log.error("request %s failed", request_id, exc_info=error)
        return internal(error, request_id)

    return failed


async def _parse(request: Request, model: type[BaseModel]):
    """The request body as `model`: malformed JSON and invalid fields are 400s naming the problem;
    a Content-Type other than application/json is a 415 (text/plain, form data and no type at all
    are what a cross-origin page can POST without asking the server first)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"The request's Content-Type is {media_type or 'missing'}; this endpoint takes "
                       "application/json. Fix: send the header Content-Type: application/json (curl: "
                       "-H 'Content-Type: application/json').", "invalid_request_error", None,
                       "unsupported_media_type")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise invalid(f"The request body nests too deeply. Fix: keep it within {MAX_JSON_DEPTH} levels.") from None
    except ValueError as error:  # malformed JSON, bytes that are not UTF-8, an integer of 4300+ digits
        raise invalid(f"The request body is not valid JSON ({error}). Fix: send a JSON object.") from None
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, got {type(body).__name__}.")
    _check_json_values(body)
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise from_validation_error(error) from None


def _check_json_values(value, path: tuple = ()) -> None:
    """400 for what json.loads accepts but no field can take: nesting deeper than MAX_JSON_DEPTH,
    and text holding a lone surrogate (it has no UTF-8 form, so the tokenizer would fail on it)."""
    if len(path) > MAX_JSON_DEPTH:
        raise invalid(f"The request body nests deeper than {MAX_JSON_DEPTH} levels in {path[0]!r}. "
                      f"Fix: keep it within {MAX_JSON_DEPTH} levels.", _param(path[:1]))
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path, "a key of ")  # the key itself cannot go into the answer
            _check_json_values(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json_values(item, path + (index,))


def _check_text(text: str, path: tuple, what: str = "") -> None:
    surrogate = LONE_SURROGATE.search(text)
    if surrogate is not None:
        param = _param(path)
        raise invalid(f"Invalid value for {what}{param!r}: the text holds a lone surrogate {ascii(surrogate.group())} "
                      f"at character {surrogate.start()}, which is not Unicode text. Fix: send valid UTF-8 (a "
                      "character beyond U+FFFF escaped as a pair of surrogates).", param, "invalid_value")


def _param(path: tuple) -> str | None:
    return ".".join(str(part) for part in path) or None


def _check_request(req: api.SamplingFields, name: str) -> None:
    if req.model != name:
        raise model_not_found(req.model, name)
    if req.n != 1:
        raise invalid(f"n={req.n} is not supported: this server returns one choice per request. "
                      "Fix: send n=1 (or leave it out) and make concurrent requests for more samples.", "n")
    if req.stream and getattr(req, "logprobs", None) not in (None, False):
        raise invalid("logprobs are not returned when streaming. Fix: set stream=false to get them.", "logprobs")


def _single_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(f"{len(prompt)} prompts in one request; this server takes one. "
                          "Fix: send one request per prompt (they are batched together anyway).", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise invalid("The prompt is empty. Fix: give at least one token of prompt.", "prompt")
    return prompt


def _sampling(llm, req: api.SamplingFields, max_tokens: int | None, logprobs: int | None) -> dict:
    """llm.submit's keywords for a request."""
    return dict(
        max_new_tokens=llm.max_seq_len if max_tokens is None else max_tokens,
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
        seed=req.seed if req.seed is not None else secrets.randbelow(2**31),
        stop=[s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or []) if s], ignore_eos=req.ignore_eos, stop_token_ids=tuple(req.stop_token_ids),
        min_p=req.min_p, typical_p=req.typical_p, eta=req.eta, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias), logprobs=logprobs, **_constraint(req))


def _constraint_param(req: api.SamplingFields) -> str | None:
    """The request field that holds its output constraint, if any (for errors naming it)."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        return "response_format"
    return "regex" if req.regex is not None else "choices" if req.choices is not None else None


def _constraint(req: api.SamplingFields) -> dict:
    """The structured-output keywords of a request (json_schema, regex or choices), if any."""
    chosen = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        chosen["json_schema"] = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid("response_format of type json_schema needs json_schema.schema. Fix: send "
                          '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.', "response_format")
        chosen["json_schema"] = fmt.json_schema.schema_
    if req.regex is not None:
        chosen["regex"] = req.regex
    if req.choices is not None:
        chosen["choices"] = req.choices
    if len(chosen) > 1:
        raise invalid(f"Give one output constraint, got {sorted(chosen)}. Fix: keep one of response_format, "
                      "regex and choices.", "response_format")
    return chosen


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """Token id -> bias (llm.submit checks the ids against the model's vocabulary)."""
    out = {}
    for key, value in (bias or {}).items():
        token = _token_key(key)
        if token is None:
            raise invalid(f"logit_bias key {key!r:.40} is not a token id. Fix: key the biases by token ids "
                          "(decimal strings, as OpenAI's API takes them).", "logit_bias")
        if not -100 <= value <= 100:
            raise invalid(f"logit_bias for token {key} is {value}; biases must be in [-100, 100].", "logit_bias")
        out[token] = float(value)
    return out


def _token_key(key: str) -> int | None:
    """A logit_bias key as a token id; None unless it is decimal digits (OpenAI's form)."""
    if not (key.isascii() and key.lstrip("-").isdigit()) or len(key) > 20:
        return None
    return int(key)


async def _submit(llm, prompt, prompt_param: str, sampling: dict, failed):
    """Queue the request (validation and tokenizing run off the event loop)."""
    try:
        return await asyncio.to_thread(llm.submit, prompt, **sampling)
    except ConstraintError as error:  # a malformed or unsatisfiable constraint, found at compiling
        raise failed(error) from None
    except KilnError as error:
        raise from_kiln_error(error, prompt_param) from None


async def _collect(handle, timer: RequestTimer, request: Request, failed):
    """The finished result of a non-streamed request; cancels it if the client goes away first.
    An exception that ended the request becomes `failed(exception)`."""

    async def drain():
        async for _ in handle:
            timer.piece()
        return await handle.wait()

    async def client_gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    generation, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({generation, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not generation.done():
            handle.cancel()
            generation.cancel()
    if not generation.done() or generation.cancelled():
        raise APIError(499, "The client closed the connection.", "client_closed_request")
    try:
        result = generation.result()
    except Exception as error:  # noqa: BLE001 - the request's failure, answered as its error
        raise failed(error) from None
    _finished(timer, result)
    return result


def _finished(timer: RequestTimer, result) -> None:
    timer.finished(len(result.prompt_token_ids), len(result.token_ids))


# -- response pieces -----------------------------------------------------------------------------
def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump())


def _usage(result) -> api.Usage:
    prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
    return api.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _card_list(name: str, created: int, max_seq_len: int) -> api.ModelList:
    return api.ModelList(data=[api.ModelCard(id=name, created=created, max_model_len=max_seq_len)])


def _default_name(llm) -> str:
    source = str(llm.manifest.get("source") or "kiln-model").rstrip("/")
    return source.rsplit("/", 1)[-1]


# -- running it ----------------------------------------------------------------------------------
def serve(llm, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info",
          allowed_hosts: list[str] | None = None) -> None:
    """Serve `llm` until interrupted (loopback only unless `host` says otherwise; Host headers
    other than `allowed_hosts`, by default `default_allowed_hosts(host)`, are refused): uvicorn in a
    thread of its own, the engine's model calls in the calling (main) thread, where torch's
    OpenMP pool runs at full speed (Engine.run_in_this_thread says why)."""
    import uvicorn

    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(host)
    app = create_app(llm, model_name, max_body_bytes, allowed_hosts)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    stop = threading.Event()

    def run_http():
        try:
            server.run()  # off the main thread uvicorn installs no signal handlers: Ctrl-C reaches us
        finally:
            stop.set()

    llm.engine.adopt_this_thread()
    http = threading.Thread(target=run_http, name="kiln-http", daemon=True)
    http.start()
    try:
        llm.engine.run_in_this_thread(stop)
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=30)
    if not server.started:
        raise KilnError(f"the HTTP server did not start on {host}:{port} (its log above says why). "
                        "Fix: free the port or pass another with --port.")
