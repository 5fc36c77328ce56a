"""Symbolic dimensions: a dim is an int or a sympy expression over named, bounded symbols."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import sympy

Dim = int | sympy.Expr

_RESERVED = {"true", "false", "none", "inf", "nan"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class SymbolBound:
    """A named dimension with inclusive bounds, e.g. `seq in [1, 2048]`."""

    name: str
    min: int
    max: int


def symbol(name: str) -> sympy.Symbol:
    """The sympy symbol for a dim name (positive integer, so shapes simplify)."""
    if not _NAME.match(name) or name in _RESERVED:
        raise ValueError(f"invalid dimension symbol name {name!r}")
    return sympy.Symbol(name, integer=True, positive=True)


def normalize(d) -> Dim:
    """Canonical form: plain ints stay ints, constant expressions become ints."""
    if isinstance(d, bool):
        raise TypeError("a bool is not a dimension")
    if isinstance(d, int):
        return d
    if isinstance(d, sympy.Basic):
        d = sympy.expand(d)
        return int(d) if d.is_Integer else d
    raise TypeError(f"not a dimension: {d!r}")


def is_dim(x) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or isinstance(x, sympy.Expr)


def format_dim(d: Dim) -> str:
    """Text form without spaces, e.g. `seq+1`, `batch*seq`."""
    return str(d) if isinstance(d, int) else str(d).replace(" ", "")


def parse_dim(text: str) -> Dim:
    """Inverse of `format_dim`."""
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return _parse_expression(text)


@lru_cache(maxsize=4096)
def _parse_expression(text: str) -> Dim:
    """A graph repeats a few expressions (`batch`, `seq`, `past+seq`) thousands of times and
    sympy's parser takes ~0.3 ms each: parsed once per text (sympy expressions are immutable)."""
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    return normalize(sympy.sympify(text, locals={n: symbol(n) for n in names}))


def free_symbols(d: Dim) -> set[str]:
    return set() if isinstance(d, int) else {s.name for s in d.free_symbols}


def evaluate(d: Dim, bindings: dict[str, int]) -> int:
    """The concrete value of a dim under symbol bindings."""
    if isinstance(d, int):
        return d
    missing = free_symbols(d) - bindings.keys()
    if missing:
        raise ValueError(f"dimension {format_dim(d)} uses unbound symbols {sorted(missing)}")
    return int(d.subs({symbol(n): v for n, v in bindings.items() if n in free_symbols(d)}))


def dims_equal(a: Dim, b: Dim) -> bool:
    if a == b:  # the common case, without sympy's simplify (the verifier compares every dim)
        return True
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0
