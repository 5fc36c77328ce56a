"""The built-in op set. Importing this package registers every op."""

from . import attention, collectives, elementwise, fused, nn, quantized, reduction, routing, shape  # noqa: F401
