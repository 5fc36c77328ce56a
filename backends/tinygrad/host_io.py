"""The host's reads and writes of a realized tinygrad buffer (a step's tokens, positions, logits).

On the CPU device the buffer's memory is the host's: numpy views of it, written and read in
place, cost nothing. On a GPU it is not: the host keeps a numpy copy, written and then copied up
whole (a step's feeds are a few hundred bytes), and refreshed from the device before a read.
"""

from __future__ import annotations

import numpy as np
from tinygrad import Tensor
from tinygrad.device import Buffer
from tinygrad.dtype import _to_np_dtype


def host_view(tensor: Tensor) -> np.ndarray:
    """A numpy array over a realized CPU tensor's memory (no copy; synchronizes first)."""
    buffer = tensor.uop.buffer.ensure_allocated()
    return np.frombuffer(buffer.as_memoryview(force_zero_copy=True), dtype=_to_np_dtype(buffer.dtype)).reshape(
        tensor.shape
    )


def on_host(tensor: Tensor) -> bool:
    """Whether a realized tensor's memory is the host's (tinygrad's CPU device)."""
    return tensor.uop.buffer.device.split(":")[0] == "CPU"


class HostIO:
    """A realized tensor as the host sees it: `write` into it, `read` out of it."""

    def __init__(self, tensor: Tensor):
        self.buffer = tensor.uop.buffer.ensure_allocated()
        self.in_place = on_host(tensor)
        if self.in_place:
            self.array = host_view(tensor)
        else:  # host memory tinygrad copies to and from (its PYTHON device holds a memoryview)
            self.array = np.zeros(tensor.shape, _to_np_dtype(self.buffer.dtype))
            raw = memoryview(self.array.reshape(-1).view(np.uint8))
            self.staging = Buffer("PYTHON", self.buffer.size, self.buffer.dtype, opaque=raw)

    def write(self, index, values: np.ndarray) -> None:
        self.array[index] = values
        if not self.in_place:
            self.buffer.copy_from(self.staging)

    def read(self, index) -> np.ndarray:
        """A copy of array[index], after the device's writes."""
        if not self.in_place:
            self.staging.copy_from(self.buffer)
        return self.array[index].copy()
