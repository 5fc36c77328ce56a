"""The root of Kiln's error types. It lives in `kiln.ir`, the one stage every other imports,
so that the dependency arrows stay one-way (runtime -> backends -> passes -> ir <- frontend)."""


class KilnError(Exception):
    """Base of every error Kiln raises on purpose; catch this to catch them all."""
