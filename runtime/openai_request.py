"""Reading an OpenAI request: the JSON body checked into its pydantic model, and the request's
settings turned into `llm.submit`'s keywords. Every problem is a 400 (or 415) naming the field.
"""

from __future__ import annotations

import json
import re
import secrets

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from kiln.runtime import openai_protocol as api
from kiln.runtime.constraint_spec import CONSTRAINT_KEYWORDS
from kiln.runtime.openai_errors import APIError, from_validation_error, invalid, model_not_found

MAX_JSON_DEPTH = 64  # far beyond any real body (a JSON schema's nesting included); bounds the recursions after it
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads makes them from escapes like "\ud800"


async def parse_body(request: Request, model: type[BaseModel]):
    """The request body as `model`: malformed JSON and invalid fields are 400s naming the problem;
    a Content-Type other than application/json is a 415 (text/plain, form data and no type at all
    are what a cross-origin page can POST without asking the server first)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(
            415,
            f"The request's Content-Type is {media_type or 'missing'}; this endpoint takes "
            "application/json. Fix: send the header Content-Type: application/json (curl: "
            "-H 'Content-Type: application/json').",
            "invalid_request_error",
            None,
            "unsupported_media_type",
        )
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
        raise invalid(
            f"The request body nests deeper than {MAX_JSON_DEPTH} levels in {path[0]!r}. "
            f"Fix: keep it within {MAX_JSON_DEPTH} levels.",
            _param(path[:1]),
        )
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
        raise invalid(
            f"Invalid value for {what}{param!r}: the text holds a lone surrogate {surrogate.group()!a} "
            f"at character {surrogate.start()}, which is not Unicode text. Fix: send valid UTF-8 (a "
            "character beyond U+FFFF escaped as a pair of surrogates).",
            param,
            "invalid_value",
        )


def _param(path: tuple) -> str | None:
    return ".".join(str(part) for part in path) or None


def check_request(req: api.SamplingFields, name: str) -> None:
    if req.model != name:
        raise model_not_found(req.model, name)
    if req.stream and getattr(req, "logprobs", None) not in (None, False):
        raise invalid("logprobs are not returned when streaming. Fix: set stream=false to get them.", "logprobs")


def single_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid(
                f"{len(prompt)} prompts in one request; this server takes one. "
                "Fix: send one request per prompt (they are batched together anyway).",
                "prompt",
            )
        prompt = prompt[0]
    if not prompt:
        raise invalid("The prompt is empty. Fix: give at least one token of prompt.", "prompt")
    return prompt


def sampling_keywords(llm, req: api.SamplingFields, max_tokens: int | None, logprobs: int | None) -> dict:
    """llm.submit's keywords for a request."""
    return dict(
        max_new_tokens=llm.max_seq_len if max_tokens is None else max_tokens,
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        seed=req.seed if req.seed is not None else secrets.randbelow(2**31),
        stop=[s for s in ([req.stop] if isinstance(req.stop, str) else req.stop or []) if s],
        ignore_eos=req.ignore_eos,
        stop_token_ids=tuple(req.stop_token_ids),
        min_p=req.min_p,
        typical_p=req.typical_p,
        eta=req.eta,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=logprobs,
        **_constraint(req),
    )


def constraint_param(req: api.SamplingFields) -> str | None:
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
            raise invalid(
                "response_format of type json_schema needs json_schema.schema. Fix: send "
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.',
                "response_format",
            )
        chosen["json_schema"] = fmt.json_schema.schema_
    if req.regex is not None:
        chosen["regex"] = req.regex
    if req.choices is not None:
        chosen["choices"] = req.choices
    if len(chosen) > 1:
        raise invalid(
            f"Give one output constraint, got {sorted(chosen)}. Fix: keep one of response_format, regex and choices.",
            "response_format",
        )
    return chosen


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """Token id -> bias (llm.submit checks the ids against the model's vocabulary)."""
    out = {}
    for key, value in (bias or {}).items():
        token = _token_key(key)
        if token is None:
            raise invalid(
                f"logit_bias key {key!r:.40} is not a token id. Fix: key the biases by token ids "
                "(decimal strings, as OpenAI's API takes them).",
                "logit_bias",
            )
        if not -100 <= value <= 100:
            raise invalid(f"logit_bias for token {key} is {value}; biases must be in [-100, 100].", "logit_bias")
        out[token] = float(value)
    return out


def _token_key(key: str) -> int | None:
    """A logit_bias key as a token id; None unless it is decimal digits (OpenAI's form)."""
    if not (key.isascii() and key.lstrip("-").isdigit()) or len(key) > 20:
        return None
    return int(key)


def with_drafter(sampling: dict, speculative: str | None) -> dict:
    """llm.submit's keywords with the server's drafter (`kiln serve --speculative`); a constrained
    request decodes without one (the grammar's forced tokens already skip decode steps)."""
    if speculative is None or any(name in sampling for name in CONSTRAINT_KEYWORDS):
        return sampling
    return {**sampling, "speculative": speculative}
