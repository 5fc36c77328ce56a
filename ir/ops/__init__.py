"""The built-in op set. Importing this package registers every op."""

from . import (  # noqa: F401
    attention,
    collectives,
    elementwise,
    fused,
    kv_quant,
    nn,
    paged_kv,
    quantized,
    reduction,
    routing,
    shape,
)
