"""FP4 (E2M1) codes two to a byte, with a scale per small block of input columns: compressed-tensors'
nvfp4-pack-quantized layers (`weight_packed` `[N, K/2]` U8, an FP8 `weight_scale` `[N, K/16]`, the scalars
`weight_global_scale` and `input_global_scale`) and mxfp4-pack-quantized ones (a U8 E8M0 scale per 32), and
gpt-oss's MXFP4 experts (config.json's `quant_method` "mxfp4").

gpt-oss stores each expert projection `P` as `P_blocks` `[E, N, K/32, 16]` (16 bytes: 32 codes) and `P_scales`
`[E, N, K/32]` (E8M0 exponents); they follow the logical weight `P` in transformers' layout `[E, K, N]` (the
dequantized `experts.gate_up_proj` `[E, H, 2I]` and `experts.down_proj` `[E, I, H]`), which the rules place.
The experts' biases and the attention sinks are plain tensors, placed by the rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import QuantizedLayoutError
from ..header import TensorInfo
from .formats import Format, Spec, fit, whole
from .placing import Axis, Companion

_BYTE = "byte of 2 FP4 codes"
#: Codes per MXFP4 block (one E8M0 scale each) and bytes per block.
MX_BLOCK, MX_BYTES = 32, 16


def fp4_packed(name: str, tensors: Mapping[str, TensorInfo], groups: Sequence[int]) -> Companion | None:
    """`name` as a companion of a compressed-tensors FP4 layer (`P.weight_packed` U8 on disk), or None."""
    prefix, _, suffix = name.rpartition(".")
    if suffix not in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
        return None
    packed = tensors.get(prefix + ".weight_packed")
    if packed is None:
        return None
    if len(packed.shape) != 2:
        raise QuantizedLayoutError(f"tensor {packed.name!r} {list(packed.shape)}: packed FP4 codes are 2-D [N, K/2]")
    wshape = (packed.shape[0], packed.shape[1] * 2)
    specs: list[tuple[Spec, str]] = {
        "weight_packed": [((Axis(0), Axis(1, 2, _BYTE)), "packed FP4 codes")],
        "weight_scale": [((Axis(0), Axis(1, g, "scale group")), f"scale per {g} codes") for g in groups],
        "weight_global_scale": [(whole(1), "global scale"), (whole(0), "global scale")],
        "input_global_scale": [(whole(1), "global scale"), (whole(0), "global scale")],
    }[suffix]
    return fit(name, tensors[name], prefix + ".weight", wshape, specs, "compressed-tensors FP4")


@dataclass(frozen=True)
class Mxfp4(Format, methods=("mxfp4",)):
    """gpt-oss's MXFP4 experts: `P_blocks` and `P_scales` beside the logical weight `P`."""

    suffixes = ("_blocks", "_scales")

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], source: str) -> Mxfp4:
        return cls()

    def companion(self, name: str, tensors: Mapping[str, TensorInfo]) -> Companion | None:
        if name.endswith("_blocks"):
            weight, is_blocks = name[: -len("_blocks")], True
        elif name.endswith("_scales"):
            weight, is_blocks = name[: -len("_scales")], False
        else:
            return None
        blocks = tensors.get(weight + "_blocks")
        if blocks is None:
            return None
        if len(blocks.shape) < 3 or blocks.shape[-1] != MX_BYTES:
            raise QuantizedLayoutError(f"tensor {blocks.name!r} {list(blocks.shape)}: MXFP4 blocks are "
                                       f"[..., N, K/{MX_BLOCK}, {MX_BYTES}]")
        *lead, n, g, _ = blocks.shape
        wshape = (*lead, g * MX_BLOCK, n)  # transformers' [E, K, N]
        k = len(lead)
        spec: Spec = tuple(Axis(i) for i in range(k)) + (Axis(k + 1), Axis(k, MX_BLOCK, "MXFP4 block"))
        spec = spec + (MX_BYTES,) if is_blocks else spec
        role = "MXFP4 blocks" if is_blocks else "MXFP4 scales"
        return fit(name, tensors[name], weight, wshape, [(spec, role)], "MXFP4")
