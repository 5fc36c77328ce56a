"""Parse the IR text form (see printer.py) back into a Graph."""

from __future__ import annotations

import json
import re

from .dims import parse_dim
from .errors import KilnError
from .graph import Graph, Value
from .printer import FORMAT_VERSION
from .tensor_type import TensorType


class ParseError(KilnError, ValueError):
    """The IR text is malformed; the message names the line."""


_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|([\[\]{},=])|([^\s\[\]{},="]+))')
_INT = re.compile(r"-?\d+$")
_FLOAT = re.compile(r"-?(\d+\.\d*(e[-+]?\d+)?|\d+e[-+]?\d+|inf|nan)$")
_NAME = r"%([\w.\-]+)"
_TYPED = re.compile(_NAME + r": ([a-z0-9]+\[[^\]]*\])")
_NODE = re.compile(r"^(.+?) = ([a-z_0-9]+)\(([^)]*)\)(?: (\{.*\}))?$")


def _tokens(text: str) -> list[str]:
    pos, out = 0, []
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise ParseError(f"bad attribute text at {text[pos:]!r}")
        out.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    return out


def _atom(tok: str):
    if tok.startswith('"'):
        return json.loads(tok)
    if _INT.match(tok):
        return int(tok)
    if _FLOAT.match(tok):
        return float(tok)
    return (
        {"true": True, "false": False, "none": None}.get(tok, None)
        if tok in ("true", "false", "none")
        else parse_dim(tok)
    )


def _parse_value(toks: list[str], i: int):
    if toks[i] == "[":
        items, i = [], i + 1
        while toks[i] != "]":
            item, i = _parse_value(toks, i)
            items.append(item)
            if toks[i] == ",":
                i += 1
        return tuple(items), i + 1
    return _atom(toks[i]), i + 1


def parse_attrs(text: str) -> dict:
    toks = _tokens(text)
    if toks[0] != "{" or toks[-1] != "}":
        raise ParseError(f"attributes must be in braces: {text!r}")
    attrs, i = {}, 1
    while toks[i] != "}":
        key, eq = toks[i], toks[i + 1]
        if eq != "=":
            raise ParseError(f"expected '=' after attribute {key!r}")
        attrs[key], i = _parse_value(toks, i + 2)
        if toks[i] == ",":
            i += 1
    return attrs


def parse_graph(text: str) -> Graph:
    """Build the graph a `print_graph` listing describes."""
    graph = Graph()
    env: dict[str, Value] = {}

    def lookup(name: str, lineno: int) -> Value:
        if name not in env:
            raise ParseError(f"line {lineno}: %{name} is used before it is defined")
        return env[name]

    lines = text.splitlines()
    if not lines or lines[0].strip() != f"kir {FORMAT_VERSION}":
        raise ParseError(f"line 1: expected the header 'kir {FORMAT_VERSION}'")
    for lineno, line in enumerate(lines[1:], start=2):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            if line.startswith("sym "):
                m = re.fullmatch(r"sym (\w+) in \[(-?\d+), (-?\d+)\]", line)
                graph.add_symbol(m.group(1), int(m.group(2)), int(m.group(3)))
            elif line.startswith("meta "):
                graph.meta = json.loads(line[5:])
            elif line.startswith(("input ", "param ")):
                m = _TYPED.fullmatch(line[6:])
                name, type_ = m.group(1), TensorType.parse(m.group(2))
                add = graph.add_input if line.startswith("input") else lambda n, t: graph.add_param(n, type=t)
                env[name] = add(name, type_)
            elif line.startswith("output"):
                names = re.findall(_NAME, line[6:])
                graph.outputs = [lookup(n, lineno) for n in names]
            else:
                m = _NODE.match(line)
                if not m:
                    raise ParseError("not a node")
                outs = _TYPED.findall(m.group(1))
                args = [a.strip() for a in m.group(3).split(",") if a.strip()]
                inputs = [None if a == "_" else lookup(a[1:], lineno) for a in args]
                attrs = parse_attrs(m.group(4)) if m.group(4) else {}
                node = graph.make_node(
                    m.group(2), inputs, attrs, [TensorType.parse(t) for _, t in outs], names=[n for n, _ in outs]
                )
                graph.append(node)
                env.update({v.name: v for v in node.outputs})
        except ParseError as e:
            raise ParseError(f"line {lineno}: {e}: {line!r}") from None
        except (AttributeError, ValueError, IndexError) as e:
            raise ParseError(f"line {lineno}: cannot parse {line!r} ({e})") from None
    return graph
