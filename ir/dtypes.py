"""IR element types: short names that print well and map one-to-one onto torch dtypes."""

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
FLOAT_DTYPES = frozenset({"f64", "f32", "f16", "bf16"})


def to_torch(dtype: str) -> torch.dtype:
    """The torch dtype of an IR dtype name."""
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown IR dtype {dtype!r}; known: {', '.join(TORCH_DTYPES)}") from None


def from_torch(dtype: torch.dtype) -> str:
    """The IR dtype name of a torch dtype."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no IR equivalent") from None


def promote(a: str, b: str) -> str:
    """Result dtype of a binary op, following torch's promotion rules."""
    return from_torch(torch.promote_types(to_torch(a), to_torch(b)))
