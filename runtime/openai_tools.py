"""Tool calling in chat completions: `tools`, `tool_choice` and `parallel_tool_calls`.

The tools reach the model through its chat template: a template that renders them itself in the
Hermes format (it takes `tools` and writes `<tool_call>`, as Qwen 2.5's does) gets them as
`tools=[...]`, the way transformers' apply_chat_template passes them. Any other template gets
them in a system message that describes the functions and the call format (Qwen's wording),
with earlier calls and tool results in the history written out as text in that format, so the
conversation works with any template.

The answer is constrained by the grammar of runtime/tool_calls.py (arguments valid under each
function's JSON schema) and parsed back into `tool_calls`, streamed as they come:
`required` and a named function answer calls only; `auto` plain text or calls; `none` plain
text (tools still shown to the model). finish_reason is "tool_calls" when the answer made calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from kiln.runtime import openai_protocol as api
from kiln.runtime.constraint_spec import CONSTRAINT_KEYWORDS
from kiln.runtime.openai_errors import invalid
from kiln.runtime.tool_calls import OPEN, ToolCallParser, call_text, parse_tool_calls, tool_grammar

SYSTEM_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools (as OpenAI sends them, which is what templates take) and how to answer."""

    tools: list[dict]
    choice: str  # "auto", "required", "none", or the name of the one function to call
    parallel: bool

    def grammar(self) -> str:
        functions = [tool["function"] for tool in self.tools]
        return tool_grammar(functions, self.choice, self.parallel)


def plan_tools(req: api.ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None without tools); 400s naming the field for what cannot work."""
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, api.NamedToolChoice) else None
    if not req.tools:
        if named is not None or choice == "required":
            raise invalid(
                f"tool_choice {named or choice!r} needs tools to call. Fix: send the functions in "
                "`tools`, or leave tool_choice out.",
                "tool_choice",
            )
        return None
    names = [tool.function.name for tool in req.tools]
    for index, tool in enumerate(req.tools):
        if names.index(tool.function.name) != index:
            raise invalid(
                f"Two tools are named {tool.function.name!r}. Fix: give each function its own name.",
                f"tools.{index}.function.name",
            )
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise invalid(
                f"tools.{index}.function.parameters must be a JSON schema of an object (the call's "
                f"named arguments), got type {parameters.get('type')!r}. Fix: describe the arguments "
                'as {"type": "object", "properties": {...}}.',
                f"tools.{index}.function.parameters",
            )
    if named is not None and named not in names:
        raise invalid(
            f"tool_choice names the function {named!r}, which is not in tools ({', '.join(names)}). "
            "Fix: name one of the tools.",
            "tool_choice",
        )
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
    return ToolPlan(tools, named or choice or "auto", req.parallel_tool_calls is not False)


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself in the call format we constrain and parse."""
    if not template or OPEN not in template:
        return False
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False  # rendering says what is wrong with it


def chat_prompt(llm, messages: list[dict], plan: ToolPlan | None) -> list[int]:
    """The conversation's token ids, with the tools in the prompt when there are any (see the
    module docstring)."""
    if plan is None:
        return llm.encode_chat(messages)
    tokenizer = llm._require_tokenizer()
    if renders_tools(tokenizer.chat_template):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=plan.tools)
    else:
        text = tokenizer.apply_chat_template(
            _with_tools_described(_as_text(messages), plan.tools), add_generation_prompt=True
        )
    return tokenizer.encode(text, add_special_tokens=False)


def _with_tools_described(messages: list[dict], tools: list[dict]) -> list[dict]:
    described = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def _as_text(messages: list[dict]) -> list[dict]:
    """The history with calls and tool results written in the call format, for templates that
    render role and content alone."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            written = [
                call_text(call["function"]["name"], json.dumps(call["function"]["arguments"], ensure_ascii=False))
                for call in calls
            ]
            message["content"] = "\n".join(([message["content"]] if message.get("content") else []) + written)
        if message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        out.append(message)
    return out


def constrain_answer(plan: ToolPlan | None, sampling: dict) -> str | None:
    """Put the tool grammar into llm.submit's keywords `sampling`; the request field a failing
    constraint is then named by ("tools"), or None where the request's own constraint stands
    (tool_choice none with a response_format)."""
    if plan is None:
        return None
    own = [name for name in CONSTRAINT_KEYWORDS if name in sampling]
    if own and plan.choice == "none":
        return None
    if own:
        raise invalid(
            f"tool_choice {plan.choice!r} constrains the answer to the tools' call format, so it "
            f"cannot also follow {own[0]}. Fix: drop response_format (regex, choices), or set "
            'tool_choice "none".',
            "response_format",
        )
    sampling["grammar"] = plan.grammar()
    return "tools"


# -- the answer ------------------------------------------------------------------------------------
def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_message(plan: ToolPlan | None, text: str) -> api.AssistantMessage:
    """The assistant message of a whole answer: its calls parsed out of the text."""
    if plan is None or plan.choice == "none":
        return api.AssistantMessage(content=text)
    parsed = parse_tool_calls(text)
    calls = [
        api.ToolCall(id=call_id(), function=api.FunctionCall(name=name, arguments=arguments))
        for name, arguments in parsed.calls
    ]
    return api.AssistantMessage(content=parsed.content, tool_calls=calls or None)


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that made calls and ended on its own."""
    return "tool_calls" if made_calls and reason == "stop" else reason


class ToolDeltas:
    """One streamed choice's text as chunk deltas: content, then each call's id and name, then
    its arguments piece by piece."""

    def __init__(self, plan: ToolPlan | None):
        self.parser = ToolCallParser() if plan is not None and plan.choice != "none" else None
        self.calls = 0

    def feed(self, piece: str) -> list[api.Delta]:
        if self.parser is None:
            return [api.Delta(content=piece)]
        return self._deltas(self.parser.feed(piece))

    def finish(self) -> list[api.Delta]:
        return self._deltas(self.parser.finish()) if self.parser is not None else []

    def _deltas(self, events) -> list[api.Delta]:
        deltas = []
        for event in events:
            if event.kind == "content":
                deltas.append(api.Delta(content=event.text))
                continue
            if event.kind == "call":
                self.calls += 1
                call = api.ToolCallDelta(
                    index=event.index,
                    id=call_id(),
                    type="function",
                    function=api.FunctionDelta(name=event.text, arguments=""),
                )
            else:
                call = api.ToolCallDelta(index=event.index, function=api.FunctionDelta(arguments=event.text))
            deltas.append(api.Delta(tool_calls=[call]))
        return deltas
