"""Tool calling in chat completions, driven by the `openai` client against a served tiny model:
a named function and `required` answer calls whose arguments are valid under the functions'
schemas, streamed calls add up to the same calls, `auto` and `none` answer plain text or calls,
and a tool's result fed back continues the conversation, with a template that renders tools
itself (Qwen 2.5's format) and with one that does not (the tools in a system message)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import kiln
from kiln.runtime import openai_protocol as api
from kiln.runtime.openai_tools import chat_prompt, plan_tools
from kiln.runtime.server import create_app
from kiln.runtime.tool_calls import parse_tool_calls
from served import served
from tiny_models import save_tiny_checkpoint

MODEL = "tiny-llama"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Qwen 2.5's template, cut to its core: tools in the system turn, calls and results in its format
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    '{% for call in message.tool_calls %}\n<tool_call>\n{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """The tiny Llama with room for the tools in its prompt (context 1024: the tiny tokenizer spends
    a token on every few characters)."""
    source = save_tiny_checkpoint("llama", tmp_path_factory.mktemp("tools") / "llama", max_position_embeddings=1024)
    return kiln.load(
        kiln.compile(str(source), out=source.parent / "m.kiln", backend="reference", max_seq_len=1024, max_batch=2)
    )


@pytest.fixture(scope="module")
def client(llm):
    with served(create_app(llm, MODEL)) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(params=["native", "system prompt"])
def template(request, llm, monkeypatch):
    """The model's chat template: one that renders tools, or the tiny models' own (it does not)."""
    if request.param == "native":
        monkeypatch.setattr(llm.tokenizer, "chat_template", TOOL_TEMPLATE)
    return request.param


@pytest.fixture
def sent(llm, monkeypatch):
    """The text of every prompt the server submits from now on."""
    prompts, submit = [], llm.submit

    def recording(prompt, **kwargs):
        prompts.append(llm.tokenizer.decode(prompt, skip_special_tokens=False))
        return submit(prompt, **kwargs)

    monkeypatch.setattr(llm, "submit", recording)
    return prompts


def direct(llm, messages, max_tokens, **request):
    """The same request through llm.generate: its prompt and grammar, greedy."""
    plan = plan_tools(api.ChatCompletionRequest(model=MODEL, messages=messages, tools=TOOLS, **request))
    return llm.generate(chat_prompt(llm, messages, plan), max_new_tokens=max_tokens, grammar=plan.grammar())


def check_calls(calls, finish_reason):
    """Every call names a tool and has arguments valid under its schema (the last may be cut
    short when the answer ran out of tokens)."""
    whole = calls if finish_reason != "length" else calls[:-1]
    for call in whole:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert all(call.function.name in SCHEMAS and call.id.startswith("call_") for call in calls)


def test_a_named_function_is_called_with_arguments_valid_under_its_schema(client, llm, template, sent):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=160, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    expected = parse_tool_calls(direct(llm, ASK, 160, tool_choice=NAMED).text).calls
    assert [(call.function.name, call.function.arguments)] == expected
    assert '"name": "get_weather"' in sent[0] and '"name": "get_time"' in sent[0]  # the tools are in the prompt
    assert ("# Tools" in sent[0]) and (('<tool_call>\n{"name": <function-name>' in sent[0]) == (template != "native"))


def test_required_calls_one_or_more_functions(client, template):
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.8, seed=3
    )
    choice = response.choices[0]
    assert choice.message.tool_calls and choice.message.content is None
    check_calls(choice.message.tool_calls, choice.finish_reason)
    single = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0.8,
        seed=3,
    )
    assert len(single.choices[0].message.tool_calls) == 1
    assert single.choices[0].finish_reason in ("tool_calls", "length")
    check_calls(single.choices[0].message.tool_calls, single.choices[0].finish_reason)


def test_streamed_calls_add_up_to_the_answer_made_whole(client, template):
    settings = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.8, seed=5, n=2
    )
    whole = client.chat.completions.create(**settings)
    calls, reasons = {}, {}
    for chunk in client.chat.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(
                    (choice.index, delta.index), {"id": delta.id, "name": delta.function.name, "arguments": ""}
                )
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    for index, choice in enumerate(whole.choices):
        streamed = [calls[key] for key in sorted(calls) if key[0] == index]
        assert [(c["name"], c["arguments"]) for c in streamed] == [
            (call.function.name, call.function.arguments) for call in choice.message.tool_calls
        ]
        assert all(c["id"].startswith("call_") for c in streamed)
        assert reasons[index] == choice.finish_reason


def test_auto_and_none_answer_text_or_calls(client, template):
    for seed in range(3):
        choice = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=40, temperature=1.0, seed=seed
        ).choices[0]
        if choice.message.tool_calls:
            check_calls(choice.message.tool_calls, choice.finish_reason)
        else:
            assert "<tool_call>" not in choice.message.content and choice.finish_reason != "tool_calls"
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=1.0, seed=seed
        ).choices[0]
        assert answer.message.tool_calls is None and "<tool_call>" not in answer.message.content


def test_a_tool_result_fed_back_continues_the_conversation(client, template, sent):
    first = (
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=160, temperature=0
        )
        .choices[0]
        .message
    )
    history = ASK + [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny, 24 degrees"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content is not None
    arguments = first.tool_calls[0].function.arguments
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in sent[-1]
    assert "<tool_response>\nSunny, 24 degrees\n</tool_response>" in sent[-1]


@pytest.mark.parametrize(
    "bad, param",
    [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=None, tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER, WEATHER]), "tools.1.function.name"),
        (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools.0.function.name"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
            "tools.0.function.parameters",
        ),
        (dict(tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}},
                        },
                    }
                ]
            ),
            "tools",
        ),  # the grammar engine refuses it
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "x-guidance": "loose"}},
                    }
                ]
            ),
            "tools",
        ),
        (dict(tool_choice="sometimes"), "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(client, bad, param):
    settings = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **bad}
    if settings["tools"] is None:
        del settings["tools"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**settings)
    assert caught.value.body["param"] == param
