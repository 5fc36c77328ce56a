"""Tool calls as the model writes them: the Hermes format (Qwen 2.5 and 3, Hermes 2 and 3), the
grammar that constrains them, and a parser that reads them back as the text streams.

A call is `<tool_call>\\n{"name": "NAME", "arguments": ARGUMENTS}\\n</tool_call>`, several calls
one after another on their own lines. The grammar (llguidance's Lark syntax) writes the name and
the keys literally and takes ARGUMENTS from the function's JSON schema (spaced as json.dumps
writes it, as templates render calls in the history), so the output parses by construction:

- a named function: exactly one call of it;
- `required`: one or more calls (one when parallel calls are off), of any of the functions;
- `auto`: either plain text holding no `<tool_call>`, or text followed by calls as `required`;
- `none`: plain text holding no `<tool_call>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# the arguments spaced as json.dumps (and so the templates' tojson) writes them in the history
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# plain text that never opens a call, and the text before a call (lazy: it ends at the first OPEN)
PLAIN_TEXT = r"PLAIN: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/"
LEAD_TEXT = 'lead[lazy]: LEAD "<tool_call>"\nLEAD: /(.|\\n)*/'


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (`arguments`: JSON text)."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{CLOSE}'


def tool_grammar(functions: list[dict], choice: str, parallel: bool) -> str:
    """The Lark grammar of an answer to `functions` ([{"name", "parameters"}, ...]) under
    `choice`: "auto", "required", "none" or a function's name (one of `functions`)."""
    if choice == "none":
        return f"start: PLAIN\n{PLAIN_TEXT}\n"
    more = ' ("\\n" call)*' if parallel else ""
    rules = [
        f"fn_{index}: {json.dumps(_head(function['name']))} %json "
        f'{json.dumps(_compact(function.get("parameters")))} "}}"'
        for index, function in enumerate(functions)
    ]
    names = [function["name"] for function in functions]
    if choice == "required":
        start = f"start: call{more}"
    elif choice == "auto":
        start = f"start: PLAIN | lead call_rest{more}\n{PLAIN_TEXT}\n{LEAD_TEXT}"
    else:
        start = f'start: "{OPEN}" "\\n" fn_{names.index(choice)} "\\n{CLOSE}"'
    body = " | ".join(f"fn_{index}" for index in range(len(functions)))
    return "\n".join([start, f'call: "{OPEN}" call_rest', f'call_rest: "\\n" ({body}) "\\n{CLOSE}"', *rules]) + "\n"


def _head(name: str) -> str:
    return f'{{"name": "{name}", "arguments": '


def _compact(schema: dict | None) -> dict:
    """The arguments' schema (no parameters: an empty object), spaced as json.dumps writes JSON
    unless its own "x-guidance" options say otherwise."""
    schema = dict(NO_PARAMETERS if schema is None else schema)
    own = schema.get("x-guidance", {})
    schema["x-guidance"] = {**JSON_STYLE, **own} if isinstance(own, dict) else own  # not a dict: llguidance says so
    return schema


# -- reading calls back ----------------------------------------------------------------------------
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
TAIL = re.compile(r"\s*\}\s*" + re.escape(CLOSE))


@dataclass(frozen=True)
class ToolEvent:
    """What a piece of text turned out to hold: "content" (text), "call" (a call named `text`
    begins, number `index`) or "arguments" (more of call `index`'s arguments)."""

    kind: str
    text: str
    index: int = 0


@dataclass
class ParsedMessage:
    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON text)


class ToolCallParser:
    """Reads text as it streams into content and calls: `feed(piece)` returns the events the text
    so far settles (text that may still open a call is held back), `finish()` the rest."""

    def __init__(self):
        self.state, self.buffer, self.calls = "text", "", 0
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, piece: str) -> list[ToolEvent]:
        self.buffer += piece
        events, progressing = [], True
        while progressing and self.buffer:
            progressing = getattr(self, f"_{self.state}")(events)
        return events

    def finish(self) -> list[ToolEvent]:
        """The text left over: content, unless the output ended inside a call (its arguments
        then stay cut short, as the text was)."""
        events = []
        if self.state == "text" and (self.calls == 0 or self.buffer.strip()):
            events.append(ToolEvent("content", self.buffer))
        elif self.state == "head":
            events.append(ToolEvent("content", OPEN + self.buffer))
        self.buffer = ""
        return [event for event in events if event.text]

    def _text(self, events: list) -> bool:
        start = self.buffer.find(OPEN)
        if start >= 0:
            self._content(events, self.buffer[:start])
            self.buffer, self.state = self.buffer[start + len(OPEN) :], "head"
            return True
        keep = next(
            (n for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1) if OPEN.startswith(self.buffer[-n:])), 0
        )
        settled = self.buffer[: len(self.buffer) - keep]
        if self.calls and not settled.strip():  # the line breaks between calls are no content
            return False
        self._content(events, settled)
        self.buffer = self.buffer[len(settled) :]
        return False

    def _content(self, events: list, text: str) -> None:
        if text and not (self.calls and not text.strip()):
            events.append(ToolEvent("content", text))

    def _head(self, events: list) -> bool:
        match = HEAD.match(self.buffer)
        if match is None or match.end() == len(self.buffer):  # more spaces may come before the arguments
            return False
        events.append(ToolEvent("call", json.loads(f'"{match.group(1)}"'), self.calls))
        self.buffer, self.state = self.buffer[match.end() :], "arguments"
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _arguments(self, events: list) -> bool:
        """Arguments text up to the end of their JSON value (depth back to 0)."""
        for position, character in enumerate(self.buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif character == "\\":
                    self._escaped = True
                elif character == '"':
                    self._in_string = False
            elif character == '"':
                self._in_string = True
            elif character in "{[":
                self._depth += 1
            elif character in "}]":
                self._depth -= 1
                if self._depth == 0:
                    events.append(ToolEvent("arguments", self.buffer[: position + 1], self.calls))
                    self.buffer, self.state = self.buffer[position + 1 :], "tail"
                    return True
        events.append(ToolEvent("arguments", self.buffer, self.calls))
        self.buffer = ""
        return False

    def _tail(self, events: list) -> bool:
        match = TAIL.match(self.buffer)
        if match is None:
            return False
        self.buffer, self.state = self.buffer[match.end() :], "text"
        self.calls += 1
        return True


def parse_tool_calls(text: str) -> ParsedMessage:
    """A whole answer's content (None when only calls, or nothing) and calls."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(event.text for event in events if event.kind == "content")
    calls: list[list[str]] = []
    for event in events:
        if event.kind == "call":
            calls.append([event.text, ""])
        elif event.kind == "arguments":
            calls[event.index][1] += event.text
    if calls:
        content = content.strip()
    return ParsedMessage(content or None, [(name, arguments) for name, arguments in calls])
