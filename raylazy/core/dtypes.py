"""The safetensors dtypes: their bit widths, byte sizes and torch equivalents."""

from __future__ import annotations

from types import MappingProxyType

#: Bits per element of every dtype safetensors 0.8 defines.
DTYPE_BITS = MappingProxyType(
    {
        "BOOL": 8,
        "U8": 8,
        "I8": 8,
        "F8_E4M3": 8,
        "F8_E5M2": 8,
        "F8_E8M0": 8,
        "F8_E4M3FNUZ": 8,
        "F8_E5M2FNUZ": 8,
        "U16": 16,
        "I16": 16,
        "F16": 16,
        "BF16": 16,
        "U32": 32,
        "I32": 32,
        "F32": 32,
        "U64": 64,
        "I64": 64,
        "F64": 64,
        "C64": 64,
        "F4": 4,
        "F6_E2M3": 6,
        "F6_E3M2": 6,
    }
)

# torch attribute names; sub-byte dtypes have no element type and load as raw uint8 bytes.
_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
}


def nbytes_of(dtype: str, numel: int) -> int | None:
    """Bytes that `numel` elements of `dtype` take, or None if not a whole number of bytes."""
    bits = DTYPE_BITS[dtype] * numel
    return bits // 8 if bits % 8 == 0 else None


def itemsize(dtype: str) -> int | None:
    """Bytes per element, or None for sub-byte dtypes (F4, F6_*)."""
    bits = DTYPE_BITS[dtype]
    return bits // 8 if bits % 8 == 0 else None


def torch_dtype(dtype: str):
    """The torch dtype a shard of `dtype` is returned as (uint8 bytes for sub-byte dtypes)."""
    import torch

    return getattr(torch, _TORCH_NAMES.get(dtype, "uint8"))
