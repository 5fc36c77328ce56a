"""Environment switches that choose among forms of a lowering, to compare them."""

from __future__ import annotations

import os

from kiln.ir.errors import OptionError


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable `name`, one of `choices` (the first when it is unset)."""
    choice = os.environ.get(name, choices[0])
    if choice not in choices:
        raise OptionError(f"{name}={choice!r} is not a choice. Fix: one of {choices}, or unset it.")
    return choice
