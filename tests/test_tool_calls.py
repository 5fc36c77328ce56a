"""Tool calls in the Hermes format: the grammar admits exactly the answers `tool_choice` allows,
with arguments valid under each function's schema, and the parser reads them back, the same
whether the text comes whole or a character at a time."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.constraint_compiler import compile_constraint
from kiln.runtime.constraint_spec import constraint_spec
from kiln.runtime.errors import ConstraintError
from kiln.runtime.tokenizer import Tokenizer
from kiln.runtime.tool_calls import ParsedMessage, ToolCallParser, call_text, parse_tool_calls, tool_grammar
from tiny_models import EOS_TOKEN_ID, VOCAB_SIZE, tokenizer_config, tokenizer_json

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
NOW = {"name": "now"}  # no parameters: the arguments are {}
PARIS = call_text("get_weather", '{"city": "Paris", "unit": "c"}')
CLOCK = call_text("now", "{}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tok")
    (directory / "tokenizer.json").write_text(tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    return Tokenizer.from_dir(directory)


def admits(tokenizer, choice: str, parallel: bool, text: str) -> bool:
    """Whether the grammar takes `text` (as the tokenizer spells it) as a whole answer."""
    spec = constraint_spec(grammar=tool_grammar([WEATHER, NOW], choice, parallel))
    constraint = compile_constraint(tokenizer, spec).start()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not constraint.allowed(VOCAB_SIZE)[token]:
            return False
        constraint.advance(token)
    return constraint.complete or bool(constraint.allowed(VOCAB_SIZE)[EOS_TOKEN_ID])  # it may end here


@pytest.mark.parametrize(
    "choice, parallel, text, taken",
    [
        ("get_weather", True, PARIS, True),
        ("get_weather", True, CLOCK, False),  # another function than the named one
        ("get_weather", True, PARIS + "\n" + PARIS, False),  # a named function is called once
        ("required", True, PARIS + "\n" + CLOCK, True),
        ("required", False, PARIS + "\n" + CLOCK, False),  # parallel_tool_calls false: one call
        ("required", True, "It is sunny.", False),
        ("required", True, PARIS.replace('"c"', '"k"'), False),  # not in the schema's enum
        ("required", True, PARIS.replace(', "unit": "c"', ""), False),  # a required argument missing
        ("required", True, PARIS.replace('{"city": "Paris"', '{"city":"Paris"'), False),  # spaced as json.dumps
        ("auto", True, "It is sunny.", True),
        ("auto", True, "Let me look. " + PARIS + "\n" + CLOCK, True),
        ("auto", False, PARIS + "\n" + CLOCK, False),
        ("auto", True, "Text with <tool_call> that is no call", False),
        ("auto", True, PARIS + " and then text", False),
        ("none", True, "It is sunny.", True),
        ("none", True, PARIS, False),
    ],
)
def test_the_grammar_admits_what_tool_choice_allows(tokenizer, choice, parallel, text, taken):
    assert admits(tokenizer, choice, parallel, text) is taken


def test_a_schema_the_grammar_engine_cannot_read_is_a_constraint_error(tokenizer):
    bad = {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}
    with pytest.raises(ConstraintError):
        compile_constraint(tokenizer, constraint_spec(grammar=tool_grammar([bad], "required", True)))


TEXTS = [
    "It is sunny.",
    "Let me look.\n" + PARIS + "\n" + CLOCK,
    call_text("get_weather", '{"city": "Pa\\"ris}{", "unit": "c"}'),  # quotes and braces inside a string
    PARIS[:-9],  # cut short inside the closing tag: the call's arguments are whole
    PARIS[:60],  # cut short inside the arguments
    PARIS[:30],
]  # cut short before the name


@pytest.mark.parametrize("text", TEXTS)
def test_parsing_a_piece_at_a_time_equals_parsing_the_whole(text):
    whole = parse_tool_calls(text)
    parser, events = ToolCallParser(), []
    for character in text:
        events += parser.feed(character)
    events += parser.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    names = [e.text for e in events if e.kind == "call"]
    arguments = ["".join(e.text for e in events if e.kind == "arguments" and e.index == i) for i in range(len(names))]
    assert list(zip(names, arguments)) == whole.calls
    assert (content.strip() if names else content) == (whole.content or "")


def test_parsed_calls_and_content():
    parsed = parse_tool_calls("Let me look.\n" + PARIS + "\n" + CLOCK)
    assert parsed.content == "Let me look."
    assert parsed.calls == [("get_weather", '{"city": "Paris", "unit": "c"}'), ("now", "{}")]
    assert parse_tool_calls(PARIS).content is None
    plain = parse_tool_calls("It is sunny.\n")
    assert plain.calls == [] and plain.content == "It is sunny.\n"  # no calls: the text as it is
    arguments = PARIS.index('{"city"')
    assert parse_tool_calls(PARIS[: arguments + 11]).calls == [("get_weather", '{"city": "P')]  # cut short
    assert parse_tool_calls(PARIS[:30]) == ParsedMessage(PARIS[:30], [])  # cut before the name: text
