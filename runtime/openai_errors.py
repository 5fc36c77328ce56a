"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with the matching status.

Every failure a request can meet maps here, so a client sees the same shape the OpenAI API
sends (and its SDK raises the matching exception class: 400 BadRequestError, 404 NotFoundError,
413/422 APIStatusError, 429 RateLimitError).
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from kiln.ir.errors import KilnError
from kiln.runtime.errors import ContextLengthError, QueueFullError, TokenIdError

RETRY_AFTER_S = 1  # what a 429 (queue full) asks the client to wait, in seconds


class APIError(KilnError):
    """A request that cannot be served, with the HTTP status and OpenAI error fields to answer."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request asks for something this server cannot do as asked."""
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist. This server serves {served!r}.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def from_validation_error(error: ValidationError) -> APIError:
    """400 naming the first field that failed validation and why."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = f"Invalid value for {param!r}: {first['msg']}" if param else first["msg"]
    code = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter"}.get(
        first["type"], "invalid_value"
    )
    return invalid(message, param, code)


def from_kiln_error(error: KilnError, prompt_param: str) -> APIError:
    """The status and code for an error the runtime raised while validating or queueing a request."""
    if isinstance(error, ContextLengthError):
        return invalid(str(error), prompt_param, "context_length_exceeded")
    if isinstance(error, QueueFullError):
        # Retry-After: a queue slot frees as soon as any request in flight finishes
        return APIError(429, str(error), "rate_limit_error", None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(error, TokenIdError):
        named = error.field in ("stop_token_ids", "logit_bias")
        return invalid(str(error), error.field if named else prompt_param, "invalid_value")
    return invalid(str(error))


def internal(error: BaseException, request_id: str | None = None) -> APIError:
    """500 for a failure that is the server's, not the request's (its first line only: a C++
    error's message goes on with a stack trace)."""
    first_line = str(error).split("\n", 1)[0][:300]
    which = f" (request id {request_id})" if request_id else ""
    return APIError(
        500, f"The server failed while generating{which}: {type(error).__name__}: {first_line}", "server_error"
    )
