"""The OpenAI API's request and response bodies, as pydantic models (the subset Kiln serves).

Requests are strict: an unknown field is an error naming it, rather than a setting silently
ignored, and values keep their JSON types (pydantic's strict mode: `"0.5"` is no number and
`"yes"` no boolean, while an integer is taken where a float is expected, as OpenAI does). Fields
common clients send that change nothing here (`store`, `metadata`, `service_tier`) are accepted
and ignored. Kiln's extra sampling settings (top_k, min_p, typical_p, eta, repetition_penalty,
ignore_eos, stop_token_ids) and output constraints (regex, choices) are accepted as extra body
fields, as vLLM does; `response_format` takes OpenAI's json_object / json_schema.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from kiln.runtime.sampler import REPETITION_PENALTY_RANGE

STRICT = dict(strict=True)  # JSON types as sent: no "0.5" -> 0.5 or "yes" -> True (an int still fills a float)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the schema the output must satisfy (name/strict are accepted)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, **STRICT)

    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """{"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}."""

    model_config = ConfigDict(extra="forbid", **STRICT)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """What both endpoints accept to steer generation."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, **STRICT)  # json.loads takes NaN and Infinity

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Kiln's extra settings (extra_body); defaults leave them off
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    eta: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    # structured output: OpenAI's response_format, or Kiln's regex / choices (extra_body)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    choices: list[str] | None = None
    # sent by common clients (the openai SDK's callers, LangChain); accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # chat with tools: False allows one call (completions ignore it)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(**STRICT)

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A tool call an assistant message made earlier in the conversation."""

    model_config = ConfigDict(extra="forbid", **STRICT)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message; content parts other than text are refused (Kiln serves text models). An
    assistant message may carry `tool_calls`, and a `tool` message answers one (`tool_call_id`):
    both go to the chat template."""

    model_config = ConfigDict(extra="allow", **STRICT)

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    """A function the model may call: `parameters` is the JSON schema of its arguments (an object)."""

    model_config = ConfigDict(extra="forbid", **STRICT)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", **STRICT)

    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the one function to call: {"type": "function", "function": {"name": ...}}."""

    model_config = ConfigDict(extra="forbid", **STRICT)

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_word(cls, value):
        """An unknown word is an error naming tool_choice itself (not a member of its union)."""
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError(
                f'{value[:40]!r} is not a tool choice: send "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}'
            )
        return value

    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# -- responses -----------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token; with `echo` the prompt's first token has null log-probability and alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None  # null when the answer is tool calls alone
    refusal: str | None = None  # OpenAI's shape: null unless the model refused (never, here)
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    """A streamed call's name (in its first chunk) or a piece of its arguments; unset fields are
    left out, as OpenAI's chunks leave them."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ToolCallDelta(BaseModel):
    """A piece of tool call `index`: its first chunk has the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "kiln"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
