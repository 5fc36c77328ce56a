"""An OpenAI-compatible HTTP server over the continuous-batching engine.

    kiln serve model.kiln [--host 127.0.0.1] [--port 8000] [--api-key KEY]
        [--speculative prompt_lookup|heads|heads+lookup] [--reward-model reward.kiln]
    app = create_app(kiln.load("model.kiln"))          # any ASGI server can run it

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template), GET
/v1/models, GET /health, GET /metrics (Prometheus), GET /openapi.json. Streaming uses server-sent
events. Each request is submitted to `llm.submit` (`n` / `best_of` samples: that many,
runtime/openai_samples.py) and shares the KV slots with every other request in flight; a full
waiting queue answers 429, and a client that goes away cancels its request. Completions' `echo`
scores the prompt (runtime/openai_echo.py); chat's `tools` are constrained, rendered and parsed
in runtime/openai_tools.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from kiln.ir.errors import KilnError
from kiln.runtime import openai_protocol as api
from kiln.runtime.api_key import ApiKeyCheck
from kiln.runtime.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from kiln.runtime.errors import ConstraintError, GenerationError
from kiln.runtime.host_check import HostCheck, default_allowed_hosts
from kiln.runtime.openai_echo import echoed_prompt, prompt_text
from kiln.runtime.openai_errors import APIError, internal, invalid, model_not_found
from kiln.runtime.openai_logprobs import chat_logprobs, completion_logprobs
from kiln.runtime.openai_request import (
    check_request,
    constraint_param,
    parse_body,
    sampling_keywords,
    single_prompt,
    with_drafter,
)
from kiln.runtime.openai_samples import (
    Samples,
    best_results,
    collect,
    finished,
    ranking_logprobs,
    sample_counts,
    sample_rewards,
    submit_samples,
)
from kiln.runtime.openai_tools import (
    ToolDeltas,
    ToolPlan,
    chat_prompt,
    constrain_answer,
    finish_reason,
    plan_tools,
    tool_message,
)
from kiln.runtime.openapi_document import openapi_document, operation
from kiln.runtime.server_metrics import RequestTimer, ServerMetrics
from kiln.runtime.sse import event, event_stream

log = logging.getLogger(__name__)

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "abort"}


def create_app(
    llm,
    model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_hosts: list[str] | None = None,
    api_key: str | None = None,
    speculative: str | None = None,
    reward_model=None,
) -> FastAPI:
    """The ASGI app serving `llm` (a loaded `kiln.LLM`) under `model_name` (default: the artifact's
    source directory name). `allowed_hosts`: the `Host` header values (port aside) answered; any
    other is a 400, which keeps a web page on another name (DNS rebinding) from reaching a
    loopback server. None answers any host; "*" in the list does too. `api_key`: every path but
    /health then needs `Authorization: Bearer <api_key>` (runtime/api_key.py). `speculative`
    ("prompt_lookup" or "heads"): every unconstrained request drafts inside the engine, by
    prompt lookup or by the artifact's draft heads.
    `reward_model` (a reward artifact from kiln.load): completions' best_of answers the samples it
    rewards most instead of the likeliest."""
    check_served_models(llm, reward_model)
    name = model_name or _default_name(llm)
    created = int(time.time())
    metrics = ServerMetrics(getattr(llm, "engine", None))
    app = FastAPI(title="Kiln", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = openapi_document(app)
    app.state.llm, app.state.model_name, app.state.metrics = llm, name, metrics
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:  # before the body is read
        app.add_middleware(ApiKeyCheck, key=api_key)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)  # added last: runs first, before the body is read
    # No CORS middleware: answers carry no Access-Control-Allow-Origin, so a browser keeps other
    # origins' pages from reading them, and POSTs they could send without a preflight (a "simple"
    # Content-Type) are refused 415 in parse_body.
    app.add_exception_handler(APIError, lambda request, error: error.response())
    app.add_exception_handler(
        HTTPException,
        lambda request, error: APIError(  # a 405 keeps its Allow header
            error.status_code, str(error.detail), "invalid_request_error", headers=error.headers
        ).response(),
    )
    app.add_exception_handler(Exception, _unexpected)

    @app.get("/health")
    async def health():
        engine = getattr(llm, "engine", None)
        paged = engine is not None and getattr(engine, "paged", None)
        return {
            "status": "ok",
            "model": name,
            "slots_in_use": engine.slots_in_use if engine else None,
            "queue_depth": engine.queue_depth if engine else None,
            **({"kv_blocks_in_use": engine.blocks_in_use, "kv_blocks_free": engine.blocks_free} if paged else {}),
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=metrics.content_type)

    @app.get("/v1/models", openapi_extra=operation(None, api.ModelList))
    async def models():
        return _card_list(name, created, llm.max_seq_len).model_dump()

    @app.get("/v1/models/{model_id:path}", openapi_extra=operation(None, api.ModelCard))
    async def model(model_id: str):
        if model_id != name:
            raise model_not_found(model_id, name)
        return _card_list(name, created, llm.max_seq_len).data[0].model_dump()

    @app.post("/v1/completions", openapi_extra=operation(api.CompletionRequest, api.CompletionResponse))
    async def completions(request: Request):
        return await _counted(
            metrics,
            "completions",
            lambda request_id: _completion(llm, name, request, metrics, request_id, speculative, reward_model),
        )

    @app.post(
        "/v1/chat/completions",
        openapi_extra=operation(api.ChatCompletionRequest, api.ChatCompletionResponse, api.ChatCompletionChunk),
    )
    async def chat_completions(request: Request):
        return await _counted(
            metrics, "chat", lambda request_id: _chat(llm, name, request, metrics, request_id, speculative)
        )

    return app


def check_served_models(llm, reward_model) -> None:
    """GenerationError unless `llm` generates and `reward_model` (if any) is a reward model."""
    if getattr(llm, "task", "generate") == "reward":
        raise GenerationError(
            "The artifact to serve is a reward model, which scores texts but does not generate. Fix: serve a "
            "causal LM, and pass the reward model with --reward-model to rank best_of samples."
        )
    if reward_model is not None and getattr(reward_model, "task", None) != "reward":
        raise GenerationError(
            "The --reward-model artifact is not a reward model. Fix: pass an artifact compiled from a "
            "*ForSequenceClassification checkpoint with one label."
        )


def _unexpected(request: Request, error: Exception) -> Response:
    """A 500 for an exception outside the generation endpoints (they answer their own), logged."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return internal(error).response()


# -- the two generation endpoints ----------------------------------------------------------------
async def _completion(
    llm,
    name: str,
    request: Request,
    metrics: ServerMetrics,
    request_id: str,
    speculative: str | None,
    reward_model=None,
) -> Response:
    timer = metrics.timer()
    req = await parse_body(request, api.CompletionRequest)
    check_request(req, name)
    if req.suffix is not None:
        raise invalid("suffix is not supported by this server. Fix: leave it out.", "suffix")
    n, best_of = sample_counts(req.n, req.best_of, req.stream)
    prompt = single_prompt(req.prompt)
    failed = _on_failure(request_id, constraint_param(req))
    sampling = sampling_keywords(llm, req, req.max_tokens, ranking_logprobs(req.logprobs, n, best_of))
    samples = await submit_samples(llm, prompt, "prompt", with_drafter(sampling, speculative), best_of, failed)
    if req.stream:
        echo = prompt_text(llm, prompt) if req.echo else None
        return event_stream(_completion_events(samples, req, name, timer, echo), samples, failed)
    drawn = await collect(samples, timer, request, failed)
    echo = None
    if req.echo:  # the prompt's log-probabilities, with the engine held alone
        echo = await asyncio.to_thread(echoed_prompt, llm, prompt, drawn[0].prompt_token_ids, req.logprobs)
    rewards = await sample_rewards(reward_model, llm, prompt, drawn, n)
    choices = []
    for index, result in enumerate(best_results(drawn, n, req.logprobs, rewards)):
        logprobs = None
        if req.logprobs is not None:
            logprobs = await asyncio.to_thread(completion_logprobs, llm, result, echo)
        choices.append(
            api.CompletionChoice(
                index=index,
                text=(echo.text if echo else "") + result.text,
                logprobs=logprobs,
                finish_reason=FINISH_REASONS.get(result.finish_reason),
            )
        )
    return _json(api.CompletionResponse(model=name, choices=choices, usage=_usage(drawn)))


async def _chat(
    llm, name: str, request: Request, metrics: ServerMetrics, request_id: str, speculative: str | None
) -> Response:
    timer = metrics.timer()
    req = await parse_body(request, api.ChatCompletionRequest)
    check_request(req, name)
    n, _ = sample_counts(req.n, None, req.stream)
    tools = plan_tools(req)
    messages = [_template_message(message, index) for index, message in enumerate(req.messages)]
    try:
        prompt = await asyncio.to_thread(chat_prompt, llm, messages, tools)
    except KilnError as error:
        raise invalid(str(error), "messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    sampling = sampling_keywords(llm, req, max_tokens, top)
    failed = _on_failure(request_id, constrain_answer(tools, sampling) or constraint_param(req))
    samples = await submit_samples(llm, prompt, "messages", with_drafter(sampling, speculative), n, failed)
    if req.stream:
        return event_stream(_chat_events(samples, req, name, timer, tools), samples, failed)
    results = await collect(samples, timer, request, failed)
    choices = []
    for index, result in enumerate(results):
        logprobs = await asyncio.to_thread(chat_logprobs, llm, result) if req.logprobs else None
        message = tool_message(tools, result.text)
        reason = finish_reason(FINISH_REASONS.get(result.finish_reason), bool(message.tool_calls))
        choices.append(api.ChatChoice(index=index, message=message, finish_reason=reason, logprobs=logprobs))
    return _json(api.ChatCompletionResponse(model=name, choices=choices, usage=_usage(results)))


def _template_message(message: api.ChatMessage, index: int) -> dict:
    """A chat message as chat templates take it (Hugging Face's convention): tool calls' JSON
    arguments parsed into objects, `developer` as `system`."""
    out = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": call.type,
                "function": {
                    "name": call.function.name,
                    "arguments": _tool_arguments(call.function.arguments, f"messages.{index}.tool_calls.{number}"),
                },
            }
            for number, call in enumerate(message.tool_calls)
        ]
    return out


def _tool_arguments(arguments: str, param: str) -> dict:
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's limit
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid(
            f"{param}.function.arguments is not a JSON object ({arguments!r:.60}). Fix: send the "
            'call\'s arguments as the text of a JSON object, e.g. \'{"city": "Paris"}\'.',
            f"{param}.function.arguments",
            "invalid_value",
        )
    return parsed


async def _completion_events(
    samples: Samples, req: api.CompletionRequest, name: str, timer: RequestTimer, echo: str | None
):
    base = dict(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name)
    for index in range(len(samples.handles) if echo else 0):  # the echoed prompt comes first
        yield event(api.CompletionResponse(**base, choices=[api.CompletionChoice(index=index, text=echo)]))
    async for index, piece in samples.pieces():
        if piece is None:  # that sample is done
            result = await samples.handles[index].wait()
            piece, reason = "", FINISH_REASONS.get(result.finish_reason)
        else:
            timer.piece()
            reason = None
        yield event(
            api.CompletionResponse(
                **base, choices=[api.CompletionChoice(index=index, text=piece, finish_reason=reason)]
            )
        )
    results = await samples.results()
    finished(timer, results)
    if req.stream_options and req.stream_options.include_usage:
        yield event(api.CompletionResponse(**base, choices=[], usage=_usage(results)))


async def _chat_events(
    samples: Samples, req: api.ChatCompletionRequest, name: str, timer: RequestTimer, tools: ToolPlan | None
):
    base = dict(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name)

    def chunk(index: int, delta: api.Delta, finish_reason=None):
        return event(
            api.ChatCompletionChunk(
                **base, choices=[api.ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)]
            )
        )

    deltas = [ToolDeltas(tools) for _ in samples.handles]  # each choice's calls parsed as they stream
    for index in range(len(samples.handles)):
        yield chunk(index, api.Delta(role="assistant", content=""))
    async for index, piece in samples.pieces():
        if piece is None:
            for delta in deltas[index].finish():
                yield chunk(index, delta)
            result = await samples.handles[index].wait()
            yield chunk(
                index, api.Delta(), finish_reason(FINISH_REASONS.get(result.finish_reason), deltas[index].calls > 0)
            )
            continue
        timer.piece()
        for delta in deltas[index].feed(piece):
            yield chunk(index, delta)
    results = await samples.results()
    finished(timer, results)
    if req.stream_options and req.stream_options.include_usage:
        yield event(api.ChatCompletionChunk(**base, choices=[], usage=_usage(results)))


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


# -- response pieces -----------------------------------------------------------------------------
def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump())


def _usage(results: list) -> api.Usage:
    """The prompt once, and every sample's tokens (best_of's dropped ones too: they were generated)."""
    prompt, completion = len(results[0].prompt_token_ids), sum(len(result.token_ids) for result in results)
    return api.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _card_list(name: str, created: int, max_seq_len: int) -> api.ModelList:
    return api.ModelList(data=[api.ModelCard(id=name, created=created, max_model_len=max_seq_len)])


def _default_name(llm) -> str:
    source = str(llm.manifest.get("source") or "kiln-model").rstrip("/")
    return source.rsplit("/", 1)[-1]


# -- running it ----------------------------------------------------------------------------------
def serve(
    llm,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    allowed_hosts: list[str] | None = None,
    api_key: str | None = None,
    speculative: str | None = None,
    reward_model=None,
) -> None:
    """Serve `llm` until interrupted (loopback only unless `host` says otherwise; Host headers
    other than `allowed_hosts`, by default `default_allowed_hosts(host)`, are refused; with
    `api_key`, requests without it are refused, /health aside; `speculative` and `reward_model` as
    create_app): uvicorn in a
    thread of its own, the engine's model calls in the calling (main) thread, where torch's
    OpenMP pool runs at full speed (Engine.run_in_this_thread says why)."""
    import uvicorn

    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(host)
    app = create_app(llm, model_name, max_body_bytes, allowed_hosts, api_key, speculative, reward_model)
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
        raise KilnError(
            f"the HTTP server did not start on {host}:{port} (its log above says why). "
            "Fix: free the port or pass another with --port."
        )
