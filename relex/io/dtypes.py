"""Names of tensor dtypes as safetensors headers, torch and the command line spell them."""

from __future__ import annotations

import torch

from relex.errors import RelexError

SAFETENSORS_TO_TORCH = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_TO_TORCH.items()}

_USER_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def parse_dtype(name: str) -> torch.dtype:
    """A dtype from a user-facing name such as `bf16`, `float32` or a safetensors tag such as `BF16`."""
    key = name.strip()
    if key in SAFETENSORS_TO_TORCH:
        return SAFETENSORS_TO_TORCH[key]
    if key.lower() in _USER_NAMES:
        return _USER_NAMES[key.lower()]
    raise RelexError(f"unknown dtype {name!r}; valid: {', '.join(sorted(_USER_NAMES))}")


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`, the spelling of config.json and the store manifest."""
    return str(dtype).removeprefix("torch.")


def from_name(name: str) -> torch.dtype:
    return getattr(torch, name)
