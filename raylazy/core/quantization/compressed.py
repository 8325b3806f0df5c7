"""compressed-tensors checkpoints (config.json's `quant_method` "compressed-tensors", as llm-compressor saves
them): each quantized layer is recognised by what lies beside it on disk, since one checkpoint may mix formats
(`mixed-precision`): `P.weight_packed` int32 is pack-quantized (`raylazy.core.quantization.packed`), U8 is
FP4 (`.fp4`), and a `P.weight` with `P.weight_scale` is float- or int-quantized (`.fp8`'s scale layouts).

The config's groups (`config_groups.*.weights`) give the bit widths, group sizes and block shapes the layouts
are checked against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import QuantizationConfigError, UnsupportedQuantizationError
from ..header import TensorInfo
from .formats import Format, field, positive
from .fp4 import fp4_packed
from .fp8 import SCALED_SUFFIXES, scaled_companion
from .packed import pack_quantized
from .placing import Companion

#: The compressed-tensors formats raylazy shards (sparse ones such as sparse-24-bitmask it does not).
KNOWN_FORMATS = ("dense", "float-quantized", "int-quantized", "naive-quantized", "pack-quantized",
                 "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mixed-precision")


@dataclass(frozen=True)
class CompressedTensors(Format, methods=("compressed-tensors",)):
    """The bit widths of its int weights, its group sizes and its block shapes, from `config_groups`."""

    suffixes = SCALED_SUFFIXES + (".weight_packed", ".weight_g_idx", ".weight_shape", ".weight_global_scale",
                                  ".input_global_scale")

    bits: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()
    blocks: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], source: str) -> CompressedTensors:
        fmt = field(raw, "format", source, str, "dense")
        groups = field(raw, "config_groups", source, dict, {})
        formats = {fmt} | {field(g, "format", source, str, fmt) for g in groups.values() if isinstance(g, dict)}
        unknown = sorted(formats - set(KNOWN_FORMATS))
        if unknown:
            raise UnsupportedQuantizationError(f"{source}: compressed-tensors format {', '.join(unknown)}: raylazy "
                                               f"shards {', '.join(KNOWN_FORMATS)}")
        bits, sizes, blocks = set(), set(), set()
        for name, group in groups.items():
            weights = field(group, "weights", source, dict, {}) if isinstance(group, dict) else None
            if weights is None:
                raise QuantizationConfigError(f"{source}: quantization_config config_groups[{name!r}] is not an object")
            packs = (group.get("format") or fmt) == "pack-quantized"
            if packs and field(weights, "type", source, str, "int") == "int" and "num_bits" in weights:
                bits.add(positive(weights["num_bits"], "num_bits", source))
            if weights.get("group_size") is not None:
                sizes.add(positive(weights["group_size"], "group_size", source))
            block = field(weights, "block_structure", source, list)
            if block is not None:
                if len(block) != 2:
                    raise QuantizationConfigError(f"{source}: quantization_config block_structure={block!r} must be "
                                                  "[block_n, block_k]")
                blocks.add(tuple(positive(b, "block_structure", source) for b in block))
        return cls(tuple(sorted(bits)), tuple(sorted(sizes)), tuple(sorted(blocks)))

    def companion(self, name: str, tensors: Mapping[str, TensorInfo]) -> Companion | None:
        packed = tensors.get(name.rpartition(".")[0] + ".weight_packed")
        if packed is None:
            return scaled_companion(name, tensors, self.blocks, self.groups, "compressed-tensors")
        if packed.dtype == "U8":
            return fp4_packed(name, tensors, self.groups)
        return pack_quantized(name, tensors, self.bits, self.groups)
