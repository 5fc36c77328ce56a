"""What a constrained request asks for — a JSON schema, a regular expression, a list of choices or
a grammar in llguidance's Lark syntax — checked and turned into llguidance grammar text (compiled
against a tokenizer in constraint_compiler.py).

    spec = constraint_spec(json_schema={"type": "object", ...})   # or regex=, choices=, grammar=

JSON is compact (no whitespace between tokens, "," and ":" separators) unless the schema's
"x-guidance" options say otherwise: compact output has more forced tokens (keys, punctuation)
for fast-forward to skip, and gives the model no room to ramble in whitespace. A regex must match
the whole output (like `re.fullmatch`), in the syntax of Rust's `regex` crate, which is Python's
for everyday patterns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kiln.runtime.errors import ConstraintError

# Compact JSON: schema "x-guidance" options still override these defaults.
JSON_DEFAULTS = {"whitespace_flexible": False}

CONSTRAINT_KEYWORDS = ("json_schema", "regex", "choices", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    """A checked constraint: llguidance grammar text, a short description for error messages,
    and whether forced tokens may be fed in one multi-token step (`fast_forward`; off, they
    still skip sampling but cost one decode step each, which gives the same output)."""

    grammar: str
    description: str
    fast_forward: bool = True


def constraint_spec(
    json_schema: Any = None,
    regex: str | None = None,
    choices: Sequence[str] | None = None,
    fast_forward: bool = True,
    grammar: str | None = None,
) -> ConstraintSpec | None:
    """The spec of at most one of `json_schema` (a dict, JSON text, or a pydantic model class),
    `regex`, `choices` and `grammar` (Lark text in llguidance's syntax, which can embed JSON
    schemas with `%json {...}`); None when none is given. Bad input raises ConstraintError."""
    given = [
        name
        for name, value in (("json_schema", json_schema), ("regex", regex), ("choices", choices), ("grammar", grammar))
        if value is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError(
            f"{' and '.join(given)} were both given. Fix: constrain a request with one of "
            "json_schema, regex, choices or grammar."
        )
    if json_schema is not None:
        grammar, description = _json_schema_grammar(json_schema)
    elif regex is not None:
        grammar, description = _regex_grammar(regex)
    elif choices is not None:
        grammar, description = _choices_grammar(choices)
    else:
        grammar, description = _lark_grammar(grammar)
    return ConstraintSpec(grammar, description, bool(fast_forward))


def _json_schema_grammar(schema: Any) -> tuple[str, str]:
    from llguidance import LLMatcher

    if hasattr(schema, "model_json_schema"):  # a pydantic model class
        schema = schema.model_json_schema()
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ConstraintError(f"json_schema is not valid JSON ({error}). Fix: pass a dict or JSON text.") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(
            f"json_schema must be a JSON schema (a dict or JSON text), got "
            f'{type(schema).__name__}. Fix: pass e.g. {{"type": "object"}}.'
        )
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except ValueError as error:
        raise ConstraintError(f"json_schema cannot be read ({error}). Fix: pass a JSON schema object.") from None
    return grammar, f"json_schema {json.dumps(schema)[:80]}"


def _regex_grammar(regex: str) -> tuple[str, str]:
    from llguidance import LLMatcher

    if not isinstance(regex, str):
        raise ConstraintError(f"regex must be a str, got {type(regex).__name__}. Fix: pass the pattern as text.")
    return LLMatcher.grammar_from_regex(regex), f"regex {regex[:80]!r}"


def _choices_grammar(choices: Sequence[str]) -> tuple[str, str]:
    from llguidance import grammar_from

    if isinstance(choices, str) or not all(isinstance(c, str) for c in choices):
        raise ConstraintError(
            f'choices must be a list of strings, got {choices!r:.80}. Fix: pass e.g. choices=["yes", "no"].'
        )
    if not choices:
        raise ConstraintError("choices is empty, so no output can satisfy it. Fix: give at least one choice.")
    return grammar_from("choice", list(choices)), f"choices {list(choices)!r:.80}"


def _lark_grammar(text: str) -> tuple[str, str]:
    from llguidance import LLMatcher

    if not isinstance(text, str):
        raise ConstraintError(
            f"grammar must be Lark text (a str), got {type(text).__name__}. "
            'Fix: pass e.g. grammar=\'start: "yes" | "no"\'.'
        )
    return LLMatcher.grammar_from_lark(text), f"grammar {text[:80]!r}"
