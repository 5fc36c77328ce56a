"""The registry behind the ATen table: `ATEN_TO_IR` and the `handles(...)` decorator that fills it.

It lives apart from the handlers so that each module of handlers (aten_table.py, aten_shapes.py)
can register into the one table without importing the other.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
ATEN_TO_IR: dict = {}


def handles(*targets):
    def register(fn):
        for t in targets:
            ATEN_TO_IR[t] = fn
        return fn

    return register


def current_meta(cx):
    """The value torch.export recorded for the node being converted (its shape and dtype)."""
    return cx.current.meta["val"]


def out_shape(cx):
    return tuple(cx.dim(d) for d in current_meta(cx).shape)
