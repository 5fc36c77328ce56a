"""Tool calls and tool results in a chat history reach the chat template, or are refused.

An assistant message's `tool_calls` and a `tool` message once vanished from the prompt without
a word. Now a template that renders them gets them (arguments as objects, as Hugging Face
templates expect), and one that does not is a 400 naming the message, never a silent drop.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import kiln
from kiln.runtime.errors import TokenizerError
from kiln.runtime.generate import LLM
from kiln.runtime.server import create_app
from tiny_models import tokenizer_config

MODEL = "tiny"
# Qwen2.5's way with tools, cut to its core
TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    '{% for call in message.tool_calls %}<tool_call>{"name": "{{ call.function.name }}", '
    '"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n'
    "{% elif message.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4C"},
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dirs, tmp_path_factory) -> LLM:
    """The tiny Llama (context 128: room for a rendered history), on the reference backend."""
    return kiln.load(
        kiln.compile(
            str(tiny_model_dirs("llama")),
            out=tmp_path_factory.mktemp("tools") / "m.kiln",
            backend="reference",
            max_seq_len=128,
            max_batch=2,
        )
    )


@pytest.fixture
def llm_with_template(loaded, monkeypatch):
    def with_template(template: str) -> LLM:
        monkeypatch.setattr(loaded.tokenizer, "chat_template", template)
        return loaded

    return with_template


def prompts_sent(llm, monkeypatch) -> list[str]:
    """The text of every prompt the server submits from now on."""
    sent, submit = [], llm.submit

    def recording(prompt, **kwargs):
        sent.append(llm.tokenizer.decode(prompt, skip_special_tokens=False))
        return submit(prompt, **kwargs)

    monkeypatch.setattr(llm, "submit", recording)
    return sent


def chat(client, messages) -> tuple[int, dict]:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    return response.status_code, response.json()


def test_a_template_that_renders_tools_gets_the_calls_and_results(llm_with_template, monkeypatch):
    llm = llm_with_template(TOOL_TEMPLATE)
    sent = prompts_sent(llm, monkeypatch)
    with TestClient(create_app(llm, MODEL)) as client:
        status, body = chat(client, HISTORY)
    assert status == 200, body
    assert (
        '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in sent[0]
        and "<tool_response>4C</tool_response>" in sent[0]
    )


def test_a_template_that_drops_tool_calls_is_a_400_naming_the_message(llm_with_template):
    llm = llm_with_template(tokenizer_config()["chat_template"])  # role + content only
    with TestClient(create_app(llm, MODEL)) as client:
        status, body = chat(client, HISTORY)
        assert status == 400 and body["error"]["param"] == "messages", body
        assert "does not render tool calls: message 1's call of 'weather'" in body["error"]["message"]
        status, body = chat(client, [{"role": "user", "content": "Hi"}])  # and the server goes on
        assert status == 200
    with pytest.raises(TokenizerError, match="does not render tool calls"):
        llm.chat([{**message, "content": message["content"] or ""} for message in HISTORY], max_new_tokens=2)


def test_a_template_that_drops_tool_results_is_a_400(llm_with_template):
    template = TOOL_TEMPLATE.replace("<tool_response>{{ message.content }}</tool_response>", "(a tool answered)")
    llm = llm_with_template(template)
    with TestClient(create_app(llm, MODEL)) as client:
        status, body = chat(client, HISTORY)
    assert status == 400 and "does not render tool results: message 2" in body["error"]["message"], body


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", "[" * 5000 + "]" * 5000])
def test_tool_call_arguments_that_are_no_json_object_are_a_400(llm_with_template, arguments):
    llm = llm_with_template(TOOL_TEMPLATE)
    history = json.loads(json.dumps(HISTORY))
    history[1]["tool_calls"][0]["function"]["arguments"] = arguments
    with TestClient(create_app(llm, MODEL)) as client:
        status, body = chat(client, history)
    assert status == 400 and body["error"]["param"] == "messages.1.tool_calls.0.function.arguments", body


def test_a_malformed_tool_call_is_a_400_naming_its_field(llm_with_template):
    llm = llm_with_template(TOOL_TEMPLATE)
    history = json.loads(json.dumps(HISTORY))
    del history[1]["tool_calls"][0]["function"]["name"]
    with TestClient(create_app(llm, MODEL)) as client:
        status, body = chat(client, history)
    assert status == 400 and body["error"]["param"] == "messages.1.tool_calls.0.function.name", body
