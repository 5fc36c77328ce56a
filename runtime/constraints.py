"""Constrained decoding, per request: which tokens the grammar allows next, which it forces, and
when it is complete. The grammar side is llguidance (an Earley parser over a lexer, computing a
token mask from the tokenizer's vocabulary); a spec compiles once per tokenizer
(constraint_compiler.py) and each request's row gets its own `Constraint` from it.

Per step the row either takes a forced token (the grammar admits only one canonical
continuation: a JSON key, punctuation, an enum's tail), without sampling, or samples from logits
whose disallowed tokens are -inf. Forced tokens can be looked ahead (`forced`), so a decode loop
can append several and feed them in one multi-token model call (fast-forward); one at a time or
all at once, the tokens are the same.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from kiln.runtime.errors import ConstraintError


class CompiledConstraint:
    """A grammar compiled against one tokenizer, shared by every row that asks for it."""

    def __init__(self, matcher, description: str, fast_forward: bool):
        self._prototype = matcher  # never advanced: rows advance copies
        self.description = description
        self.fast_forward = fast_forward

    def start(self) -> Constraint:
        """A fresh state for one row (a copy of the compiled matcher, microseconds)."""
        return Constraint(self._prototype.deep_copy(), self.description, self.fast_forward)


class Constraint:
    """One row's position in its grammar."""

    def __init__(self, matcher, description: str, fast_forward: bool = True):
        self._matcher = matcher
        self.description = description
        self.fast_forward = fast_forward
        self._forced: deque[int] = deque()  # tokens forced after the current state, in order
        self._forced_all = False  # whether _forced holds every token forced from here on

    @property
    def complete(self) -> bool:
        """The grammar admits nothing more (only an end of sequence): the output is finished."""
        return self._matcher.is_stopped()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (EOS once it is accepting).
        Raises ConstraintError when none is allowed: the grammar cannot be satisfied from here."""
        # numpy, in this thread: vocab-sized torch ops would wake its thread pool on every step
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        self._check()
        allowed = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, bits.size)
        allowed[:n] = bits[:n]
        if not allowed.any():
            raise ConstraintError(
                f"No token can continue the output under {self.description}. Fix: check that "
                "some text satisfies the constraint, and that the model's vocabulary can spell it."
            )
        return torch.from_numpy(allowed)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next, in order (without advancing)."""
        probe = None
        while len(self._forced) < limit and not self._forced_all:
            if probe is None:
                probe = self._matcher.deep_copy()
                probe.consume_tokens(list(self._forced))
            more = probe.compute_ff_tokens()
            if not more or not probe.consume_tokens(more):
                self._forced_all = True
                break
            self._forced.extend(more)
        return list(self._forced)[: max(0, limit)]

    def advance(self, token: int) -> bool:
        """Take `token` (sampled or forced); whether it was the forced one. A token the grammar
        does not allow raises ConstraintError."""
        if not self._matcher.consume_token(int(token)):
            raise ConstraintError(
                f"Token {token} does not fit {self.description} ({_first_line(self._matcher)}). "
                "Fix: choose tokens from allowed(); if it came from there, the constraint needs "
                "text this model's vocabulary cannot spell (a character whose bytes it lacks): "
                "constrain to other text."
            )
        was_forced = bool(self._forced) and self._forced[0] == token
        if was_forced:
            self._forced.popleft()
        else:
            self._forced.clear()
            self._forced_all = False
        return was_forced

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(
                f"No output can satisfy {self.description} from here "
                f"({_first_line(self._matcher)}). Fix: check that some text "
                "matches the constraint."
            )


def _first_line(matcher) -> str:
    """llguidance's error without the parser state it appends (many lines of it)."""
    lines = matcher.get_error().strip().splitlines()
    return (lines[0] if lines else "no detail")[:200]
