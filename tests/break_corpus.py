"""Small models that each make Dynamo break for a different reason: the graph-break test corpus.

Every line where Dynamo breaks ends with a marker `# BREAK: <category>`; the tests read the
markers to know where each break must be reported and in which category. Each `CASES` entry
names a factory returning `(module, inputs)` (the form `compile-model explain file.py:factory`
takes; inputs that calls mutate come as a function making fresh ones) and whether Kiln's
remedies must bring it to a single graph.
"""

from __future__ import annotations

import logging
import threading
import warnings
import zlib
from dataclasses import dataclass

import torch
from torch import nn

HIDDEN = 16
logger = logging.getLogger("kiln.tests.break_corpus")


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(HIDDEN, HIDDEN)
        self.down = nn.Linear(HIDDEN, HIDDEN)


class TensorIf(_Base):
    """`if` on a tensor's value, both arms pure: Kiln rewrites it into a select."""

    def forward(self, x):
        h = self.up(x)
        if h.sum() > 0:  # BREAK: data_dependent_control_flow
            y = torch.relu(h) * 2
        else:
            y = torch.tanh(h) - 1
        return self.down(y)


class TensorIfReturn(_Base):
    """`if cond: return a` then `return b`: also rewritten into a select."""

    def forward(self, x):
        h = self.up(x)
        if h.mean() < 0:  # BREAK: data_dependent_control_flow
            return self.down(h) * 0.5
        return self.down(h) + 1


class TensorWhile(_Base):
    """A loop on a tensor condition: no remedy (the trip count depends on the data)."""

    def forward(self, x):
        h = self.up(x)
        while h.abs().max() > 1.0:  # BREAK: data_dependent_control_flow
            h = h * 0.5
        return self.down(h)


class ItemScalar(_Base):
    """`.item()` on a reduction: captured as a symbolic scalar."""

    def forward(self, x):
        h = self.up(x)
        scale = h.abs().max().item()  # BREAK: scalar_escape
        return self.down(h / (scale + 1.0))


class FloatTolist(_Base):
    """`.tolist()` on a float tensor: no remedy (Dynamo follows only integer lists)."""

    def forward(self, x):
        h = self.up(x)
        weights = h.mean(dim=0).tolist()  # BREAK: scalar_escape
        return self.down(h) * len(weights)


class MaskedSelect(_Base):
    """Boolean-mask indexing: a data-dependent output size, captured as a symbol."""

    def forward(self, x):
        h = self.up(x)
        positive = h[h > 0]  # BREAK: dynamic_shape
        return self.down(h) + positive.sum()


class PrintInForward(_Base):
    """`print` inside forward: moved after the graph."""

    def forward(self, x):
        h = self.up(x)
        print("hidden", h.shape)  # BREAK: python_side_effect
        return self.down(h)


class LoggerInForward(_Base):
    """A logger call inside forward: dropped from the graph."""

    def forward(self, x):
        h = self.up(x)
        logger.info("hidden %s", h.shape)  # BREAK: python_side_effect
        return self.down(h)


class WarningInForward(_Base):
    """`warnings.warn` inside forward: moved after the graph."""

    def forward(self, x):
        h = self.up(x)
        warnings.warn("corpus warning", stacklevel=1)  # BREAK: python_side_effect
        return self.down(h)


class CExtensionCall(_Base):
    """A C-extension function (zlib) called in forward: no remedy."""

    def forward(self, x):
        h = self.up(x)
        salt = zlib.crc32(b"kiln") % 7  # BREAK: unsupported_call
        return self.down(h) + salt


class ExplicitBreak(_Base):
    """`torch._dynamo.graph_break()`: the author asked for it; no remedy."""

    def forward(self, x):
        h = self.up(x)
        torch._dynamo.graph_break()  # BREAK: user_requested
        return self.down(h)


class LockedKVCache:
    """A Python KV cache guarded by a lock, as a thread-safe server might write it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.keys: list[torch.Tensor] = []

    def update(self, key: torch.Tensor) -> torch.Tensor:
        with self._lock:  # BREAK: cache_object
            self.keys.append(key)
            return torch.cat(self.keys, dim=1)


class CacheObjectModel(_Base):
    """Attention over a Python cache object: the stateless capture drops the cache."""

    def forward(self, x, past_key_values: LockedKVCache | None = None, use_cache: bool = True):
        h = self.up(x)
        keys = past_key_values.update(h) if use_cache and past_key_values is not None else h
        weights = torch.softmax(h @ keys.transpose(1, 2) / HIDDEN**0.5, dim=-1)
        return self.down(weights @ keys)


def _x(batch: int = 2, seq: int = 5) -> torch.Tensor:
    return torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(1))


def tensor_if():
    return TensorIf(), (_x(),)


def tensor_if_return():
    return TensorIfReturn(), (_x(),)


def tensor_while():
    return TensorWhile(), (_x() * 8,)


def item_scalar():
    return ItemScalar(), (_x(),)


def float_tolist():
    return FloatTolist(), (_x(),)


def masked_select():
    return MaskedSelect(), (_x(),)


def print_in_forward():
    return PrintInForward(), (_x(),)


def logger_in_forward():
    return LoggerInForward(), (_x(),)


def warning_in_forward():
    return WarningInForward(), (_x(),)


def c_extension_call():
    return CExtensionCall(), (_x(),)


def explicit_break():
    return ExplicitBreak(), (_x(),)


def cache_object():
    return CacheObjectModel(), lambda: {"x": _x(), "past_key_values": LockedKVCache(), "use_cache": True}


@dataclass(frozen=True)
class Case:
    factory: str  # a function of this file returning (module, inputs)
    eliminable: bool  # Kiln's remedies must leave a single graph
    classes: tuple[str, ...]  # the classes whose `# BREAK:` markers this case must hit


CASES = [
    Case("tensor_if", True, ("TensorIf",)),
    Case("tensor_if_return", True, ("TensorIfReturn",)),
    Case("tensor_while", False, ("TensorWhile",)),
    Case("item_scalar", True, ("ItemScalar",)),
    Case("float_tolist", False, ("FloatTolist",)),
    Case("masked_select", True, ("MaskedSelect",)),
    Case("print_in_forward", True, ("PrintInForward",)),
    Case("logger_in_forward", True, ("LoggerInForward",)),
    Case("warning_in_forward", True, ("WarningInForward",)),
    Case("c_extension_call", False, ("CExtensionCall",)),
    Case("explicit_break", False, ("ExplicitBreak",)),
    Case("cache_object", True, ("CacheObjectModel", "LockedKVCache")),
]


def break_markers(class_name: str) -> dict[int, str]:
    """{line: category} for the `# BREAK:` markers in the class `class_name` of this file."""
    import inspect

    lines, first = inspect.getsourcelines(globals()[class_name])
    return {first + i: line.split("# BREAK:")[1].strip() for i, line in enumerate(lines) if "# BREAK:" in line}
