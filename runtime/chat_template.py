"""Rendering a Hugging Face chat template (Jinja) the way transformers does.

Templates come from model repositories, so they are untrusted code: they render in Jinja's
immutable sandbox with the same helpers transformers provides (`raise_exception`, a `tojson`
that does not escape HTML, `strftime_now`), `trim_blocks`/`lstrip_blocks` and loop controls.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.runtime.errors import TokenizerError


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """A sandboxed Jinja template for a chat template's source text."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(
            f"The chat template does not parse (line {e.lineno}: {e.message}). "
            "Fix: correct `chat_template` in tokenizer_config.json."
        ) from None


def select_chat_template(template) -> str | None:
    """The default template from tokenizer_config's `chat_template` (a string, or a list of
    {name, template} entries in older checkpoints)."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]; an assistant message
    may hold `tool_calls`, a `tool` message a call's result). A template that leaves a tool call
    or a tool result out of the prompt raises TokenizerError rather than losing it silently."""
    try:
        prompt = compile_chat_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:
        raise TokenizerError(
            f"The chat template refused these messages: {e}. "
            "Fix: check the roles and their order (e.g. system first, user/assistant alternating)."
        ) from None
    _check_tool_messages(messages, prompt)
    return prompt


def _check_tool_messages(messages: list[dict], prompt: str) -> None:
    """TokenizerError naming the first tool call (by its function's name) or tool result (by its
    text) that the rendered prompt does not hold."""
    for index, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            name = (call.get("function") or {}).get("name") or call.get("name")
            if name and name not in prompt:
                raise TokenizerError(
                    f"This model's chat template does not render tool calls: message {index}'s call "
                    f"of {name!r} is not in the prompt. Fix: use a model whose chat template renders "
                    "tool_calls, or put the call into the assistant message's content as text."
                )
        content = message.get("content")
        if message.get("role") == "tool" and isinstance(content, str) and not _rendered(content, prompt):
            raise TokenizerError(
                f"This model's chat template does not render tool results: message {index} (role "
                "'tool') is not in the prompt. Fix: use a model whose chat template renders tool "
                "messages, or send the result as a user message."
            )


def _rendered(text: str, prompt: str) -> bool:
    """Whether the prompt holds `text` as templates write it: as is, trimmed, or JSON-escaped (tojson)."""
    text = text.strip()
    return not text or text in prompt or json.dumps(text, ensure_ascii=False)[1:-1] in prompt
