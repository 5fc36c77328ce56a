"""TensorType: an element dtype and a shape of ints and symbolic dims."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .dims import Dim, format_dim, free_symbols, normalize, parse_dim
from .dtypes import TORCH_DTYPES


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self):
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        object.__setattr__(self, "shape", tuple(normalize(d) for d in self.shape))

    @property
    def rank(self) -> int:
        return len(self.shape)

    def symbols(self) -> set[str]:
        return set().union(*(free_symbols(d) for d in self.shape)) if self.shape else set()

    def with_shape(self, shape) -> TensorType:
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: str) -> TensorType:
        return TensorType(dtype, self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(format_dim(d) for d in self.shape)}]"

    @staticmethod
    def parse(text: str) -> TensorType:
        m = re.fullmatch(r"\s*([a-z0-9]+)\[(.*)\]\s*", text)
        if not m:
            raise ValueError(f"not a tensor type: {text!r}")
        body = m.group(2).strip()
        shape = tuple(parse_dim(p) for p in body.split(",")) if body else ()
        return TensorType(m.group(1), shape)
