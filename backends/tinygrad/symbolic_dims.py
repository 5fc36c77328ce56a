"""IR dims (ints or sympy expressions over graph symbols) as tinygrad sizes (ints or UOps).

Inside a jitted function a graph symbol is either a plain int (`batch`, and `seq` = 1 when
decoding) or a tinygrad `Variable` (`seq` when prefilling), so one traced program serves every
prompt length. An attribute such as `shape=[batch, seq, 4, 16]` or `end=seq+past` becomes the
same arithmetic on those sizes.
"""

from __future__ import annotations

import sympy

from kiln.backends.errors import LoweringError

DimLoweringError = LoweringError  # a dim with an unbound symbol, or arithmetic tinygrad sizes cannot express


def to_size(d, bindings: dict):
    """The tinygrad size of IR dim `d` under `bindings` (symbol name -> int or Variable UOp)."""
    if isinstance(d, int):
        return d
    if d.is_Integer:
        return int(d)
    if isinstance(d, sympy.Symbol):
        if d.name not in bindings:
            raise DimLoweringError(f"symbol {d.name} has no value in the tinygrad program (bound: {sorted(bindings)})")
        return bindings[d.name]
    if isinstance(d, sympy.Add):
        return _fold(lambda a, b: a + b, [to_size(t, bindings) for t in d.args])
    if isinstance(d, sympy.Mul):
        return _fold(lambda a, b: a * b, [to_size(t, bindings) for t in d.args])
    if isinstance(d, sympy.Pow) and d.exp.is_Integer and d.exp > 0:
        return _fold(lambda a, b: a * b, [to_size(d.base, bindings)] * int(d.exp))
    if isinstance(d, sympy.floor):
        numerator, denominator = sympy.fraction(sympy.together(d.args[0]))
        if denominator.is_Integer:
            return to_size(sympy.expand(numerator), bindings) // int(denominator)
    if isinstance(d, sympy.Mod) and d.args[1].is_Integer:
        return to_size(d.args[0], bindings) % int(d.args[1])
    raise DimLoweringError(f"dim expression {d} has no tinygrad form (supported: + * ** floor mod)")


def to_attr(value, bindings: dict):
    """An attribute with every sympy dim inside replaced by its tinygrad size."""
    if isinstance(value, tuple):
        return tuple(to_attr(v, bindings) for v in value)
    if isinstance(value, sympy.Expr):
        return to_size(value, bindings)
    return value


def _fold(fn, items):
    result = items[0]
    for item in items[1:]:
        result = fn(result, item)
    return result
