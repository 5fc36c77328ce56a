"""The built-in op set. Importing this package registers every op."""

from . import elementwise, reduction, shape, nn, attention, fused, quantized, collectives, routing  # noqa: F401
