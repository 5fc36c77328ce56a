"""The op registry: each op is registered once with its schema, type rule, reference kernel and
traits, the properties passes and backends ask about (`ops_with("elementwise")`) instead of
keeping their own lists of op names."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import KilnError
from .tensor_type import TensorType

REQUIRED = object()  # marks an attribute with no default

TRAITS = {
    "elementwise": "each output element depends only on the inputs' elements at the same index, "
    "after broadcasting (so the op keeps any split, layout or row selection of its inputs)",
    "commutative": "a binary op whose two operands can be swapped without changing the result",
    "constant": "takes no inputs: the output is made from the attributes alone",
}


class OpError(KilnError, ValueError):
    """An op was applied to inputs or attributes its schema rejects."""


@dataclass(frozen=True)
class OpDef:
    """An op's schema, type rule and reference implementation.

    `inputs` names the operands: `x` required, `bias?` optional (may be None), `xs*` variadic
    (last only). `infer(*input_types, **attrs)` returns the output types; `reference(*tensors,
    **attrs)` computes the outputs with plain torch on CPU (a tensor or a tuple of tensors).
    """

    name: str
    inputs: tuple[str, ...]
    infer: Callable[..., TensorType | tuple[TensorType, ...]]
    reference: Callable[..., Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    doc: str = ""
    traits: frozenset[str] = frozenset()

    def __post_init__(self):
        object.__setattr__(self, "traits", frozenset(self.traits))
        for trait in self.traits:
            _check_trait(trait)

    @property
    def variadic(self) -> bool:
        return bool(self.inputs) and self.inputs[-1].endswith("*")

    def check_arity(self, n: int) -> None:
        fixed = [i for i in self.inputs if not i.endswith("*")]
        required = [i for i in fixed if not i.endswith("?")]
        if n < len(required) or (not self.variadic and n > len(fixed)):
            raise OpError(f"{self.name} takes inputs ({', '.join(self.inputs)}), got {n}")

    def complete_attrs(self, attrs: dict) -> dict:
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise OpError(f"{self.name} has no attribute(s) {sorted(unknown)}; it takes {sorted(self.attrs)}")
        full = {}
        for key, default in self.attrs.items():
            if key in attrs:
                full[key] = attrs[key]
            elif default is REQUIRED:
                raise OpError(f"{self.name} needs the attribute {key!r}")
            else:
                full[key] = default
        return full

    def infer_types(self, input_types: list[TensorType | None], attrs: dict) -> list[TensorType]:
        self.check_arity(len(input_types))
        for spec, t in zip(self.inputs, input_types):
            if t is None and not spec.endswith("?"):
                raise OpError(f"{self.name}: input {spec!r} is required")
        out = self.infer(*input_types, **attrs)
        return list(out) if isinstance(out, (tuple, list)) else [out]


_REGISTRY: dict[str, OpDef] = {}


def _check_trait(trait: str) -> None:
    if trait not in TRAITS:
        raise OpError(f"unknown op trait {trait!r}. Fix: use one of {sorted(TRAITS)} (ir/registry.py TRAITS)")


def register(op: OpDef) -> OpDef:
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    _REGISTRY[op.name] = op
    ops_with.cache_clear()
    return op


def get_op(name: str) -> OpDef:
    from . import ops  # noqa: F401  (registers the built-in op set)

    try:
        return _REGISTRY[name]
    except KeyError:
        raise OpError(f"unknown IR op {name!r}") from None


def all_ops() -> dict[str, OpDef]:
    from . import ops  # noqa: F401

    return dict(_REGISTRY)


@functools.cache
def ops_with(trait: str) -> frozenset[str]:
    """The names of the registered ops that have `trait` (one of TRAITS)."""
    from . import ops  # noqa: F401

    _check_trait(trait)
    return frozenset(name for name, op in _REGISTRY.items() if trait in op.traits)
