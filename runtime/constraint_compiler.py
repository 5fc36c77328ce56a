"""Compiling constraint specs against a tokenizer, once each.

llguidance needs its own view of the tokenizer (every token's bytes; about half a second for a
50k vocabulary), so there is one `ConstraintCompiler` per `Tokenizer`, kept as long as the
tokenizer lives. It compiles a grammar the first time a request asks for it and keeps the last
`CACHE_SIZE` of them, so a server answering the same schema again pays nothing but a copy.
Compiling checks the grammar: a malformed one, or one that no output can satisfy, raises
`ConstraintError` before any model call.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from kiln.runtime.constraint_spec import CONSTRAINT_KEYWORDS, ConstraintSpec, constraint_spec
from kiln.runtime.constraints import CompiledConstraint, Constraint
from kiln.runtime.errors import ConstraintError

CACHE_SIZE = 64


class ConstraintCompiler:
    """llguidance's tokenizer for one Kiln `Tokenizer`, and the grammars compiled against it."""

    def __init__(self, tokenizer):
        from llguidance import LLTokenizer

        eos = sorted(tokenizer.eos_ids) or None  # None: llguidance finds the tokenizer's own
        self.lltokenizer = LLTokenizer(tokenizer.to_json(), eos_token=eos)
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The spec's grammar, compiled (or taken from the cache) and checked."""
        with self._lock:
            matcher = self._compiled.get(spec.grammar)
            if matcher is None:
                matcher = self._build(spec)
                self._compiled[spec.grammar] = matcher
                if len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(spec.grammar)
        return CompiledConstraint(matcher, spec.description, spec.fast_forward)

    def _build(self, spec: ConstraintSpec):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.lltokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            message = matcher.get_error().strip().splitlines()
            raise ConstraintError(
                f"{spec.description} cannot be compiled: {' '.join(message)[:300]}. "
                "Fix: correct the constraint (llguidance's JSON-schema and regex subsets)."
            )
        # The first mask shows a grammar no text satisfies (e.g. an empty character class).
        Constraint(matcher.deep_copy(), spec.description).allowed(self.lltokenizer.vocab_size)
        return matcher


_compilers: weakref.WeakKeyDictionary[object, ConstraintCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer) -> ConstraintCompiler:
    """The tokenizer's compiler, built on first use."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = ConstraintCompiler(tokenizer)
        return compiler


def compile_constraint(tokenizer, spec: ConstraintSpec | None) -> CompiledConstraint | None:
    """`spec` compiled against `tokenizer` (None stays None)."""
    if spec is None:
        return None
    if tokenizer is None:
        raise ConstraintError(
            f"{spec.description} needs the artifact's tokenizer, and this artifact has none. "
            "Fix: recompile from a model directory with tokenizer.json."
        )
    return compiler_for(tokenizer).compile(spec)


def pop_constraint(tokenizer, options: dict) -> CompiledConstraint | None:
    """Take `json_schema`, `regex`, `choices` and `fast_forward` out of generate's keyword options
    and compile them (None when none of the first three is given)."""
    chosen = {name: options.pop(name) for name in CONSTRAINT_KEYWORDS if name in options}
    fast_forward = options.pop("fast_forward", True)
    return compile_constraint(tokenizer, constraint_spec(**chosen, fast_forward=fast_forward))
