"""Quantized checkpoints: config.json's `quantization_config` read into a format (`formats`), and each companion
tensor of a quantized layer (scales, zero points, packed codes) placed as the rules place its weight (`placing`).

One module per format family: `fp8` (FP8/int8 weights stored whole with scales), `packed` (GPTQ, AWQ and
compressed-tensors' int codes packed in int32 words), `fp4` (NVFP4 and MXFP4 codes two to a byte), `compressed`
(compressed-tensors, which picks among those per layer).
"""

from __future__ import annotations

from . import compressed, fp4, fp8, packed  # noqa: F401  (each registers its formats)
from .formats import FORMATS, Format, parse_quantization
from .placing import Axis, Companion, Following, Layout

__all__ = ["FORMATS", "Axis", "Companion", "Following", "Format", "Layout", "parse_quantization"]
