"""FP8 (or int8) weights stored whole beside float scales: config.json's `quant_method` "fp8" (transformers'
FineGrainedFP8 and vLLM's Fp8Config: `weight_scale_inv` per 128x128 block as DeepSeek-V3/R1, Kimi-K2 and
Qwen3-FP8 store it, or `weight_scale` per tensor or output channel) and "fbgemm_fp8"; the scale layouts are
shared with compressed-tensors' float- and int-quantized layers.

The weight keeps its own name and rules; its scales follow it. Scalars (`input_scale`, `activation_scale`,
the kv-cache `k_scale`/`v_scale`) go whole to every rank that holds the weight. transformers 5's fused experts
(`experts.gate_up_proj` `[E, 2I, H]`) keep their scales beside them as `experts.gate_up_proj_scale_inv`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import QuantizationConfigError
from ..header import TensorInfo
from .formats import Format, Spec, field, first_fit, fit, positive, whole
from .placing import Axis, Companion, Layout

#: Companions that are scales of the weight's values (their shape says per block, group, channel or tensor).
SCALES = ("weight_scale_inv", "weight_scale", "weight_zero_point")
#: Companions that are one number per tensor (or per expert of fused experts).
SCALARS = ("input_scale", "input_zero_point", "activation_scale", "output_scale")
#: The kv-cache scales vLLM reads, beside `self_attn` or its k/v projection, and the projection they belong to.
KV_SCALES = {"k_scale": "k_proj", "v_scale": "v_proj", "q_scale": "q_proj"}


def scale_specs(wshape: tuple[int, ...], blocks: Sequence[tuple[int, int]] = (),
                groups: Sequence[int] = ()) -> list[tuple[Spec, str]]:
    """The layouts a scale of a weight `[*lead, N, K]` may have, most specific first: a grid of `blocks`,
    one per group of K (`groups`), per output channel, per tensor (per expert with leading expert dims)."""
    lead = tuple(Axis(i) for i in range(len(wshape) - 2))
    n, k = len(wshape) - 2, len(wshape) - 1
    specs = [(lead + (Axis(n, bn, "scale block"), Axis(k, bk, "scale block")), f"{bn}x{bk} block scale")
             for bn, bk in blocks]
    specs += [(lead + (Axis(n), Axis(k, g, "quantization group")), f"scale per group of {g}") for g in groups]
    specs += [(lead + (Axis(n), 1), "per-channel scale"), (lead + (Axis(n),), "per-channel scale")]
    return specs + scalar_specs(wshape)


def scalar_specs(wshape: tuple[int, ...]) -> list[tuple[Spec, str]]:
    """One number per tensor (`[]` or `[1]`), or per expert of a weight with leading expert dims."""
    lead = tuple(Axis(i) for i in range(len(wshape) - 2))
    return ([(lead, "scale per expert"), (lead + (1,), "scale per expert")] if lead else []) + \
        [(whole(0), "per-tensor scale"), ((1,), "per-tensor scale")]


_SCALES, _SCALED = frozenset(SCALES), frozenset(SCALES + SCALARS)
#: A Companion made in C: DeepSeek-V3 has 45,808 scales, and a NamedTuple's own constructor is Python.
_companion = functools.partial(tuple.__new__, Companion)


def scaled_companion(name: str, tensors: Mapping[str, TensorInfo], blocks: tuple[tuple[int, int], ...],
                     groups: tuple[int, ...], what: str) -> Companion | None:
    """`name` as a companion of an FP8/int8 weight stored whole (`P.weight` beside `P.weight_scale`...), or None."""
    prefix, _, suffix = name.rpartition(".")
    if suffix in _SCALED:
        weight = tensors.get(prefix + ".weight")
    elif suffix in KV_SCALES:
        weight = tensors.get(prefix + ".weight") or tensors.get(f"{prefix}.{KV_SCALES[suffix]}.weight")
    elif name.endswith("_scale_inv") or name.endswith("_activation_scale"):  # transformers 5's fused experts
        weight = tensors.get(name[: -len("_scale_inv")] if name.endswith("_scale_inv")
                             else name[: -len("_activation_scale")])
        suffix = "weight_scale_inv" if name.endswith("_scale_inv") else "activation_scale"
    else:
        return None
    if weight is None or len(weight.shape) < 2:
        return None
    scale, t = suffix in _SCALES, tensors[name]
    layout = _layout(t.shape, weight.shape, blocks, groups, scale)
    if layout is None:  # fit names what was expected
        fit(name, t, weight.name, weight.shape, _specs(weight.shape, blocks, groups, scale), what)
    return _companion((weight.name, layout))


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], wshape: tuple[int, ...], blocks: tuple, groups: tuple, scale: bool) -> Layout | None:
    """The layout of a scale (`scale`) or scalar of `shape` beside a weight of `wshape`. Cached: DeepSeek-V3 asks
    it for 45,808 scales of a dozen shapes."""
    return first_fit(shape, wshape, _specs(wshape, blocks, groups, scale))


def _specs(wshape: tuple[int, ...], blocks: tuple, groups: tuple, scale: bool) -> list[tuple[Spec, str]]:
    return scale_specs(wshape, blocks, groups) if scale else scalar_specs(wshape)


#: How the names of `scaled_companion`'s companions end.
SCALED_SUFFIXES = tuple(f".{s}" for s in (*SCALES, *SCALARS, *KV_SCALES)) + ("_scale_inv", "_activation_scale")


@dataclass(frozen=True)
class Fp8(Format, methods=("fp8", "fbgemm_fp8")):
    """FP8 weights with block scales (`weight_block_size`), or per-channel or per-tensor scales."""

    suffixes = SCALED_SUFFIXES

    #: `weight_block_size`, (block_n, block_k); none: scales per channel or per tensor.
    blocks: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], source: str) -> Fp8:
        block = field(raw, "weight_block_size", source, (list, tuple))
        if block is None:
            return cls()
        if len(block) != 2:
            raise QuantizationConfigError(f"{source}: quantization_config weight_block_size={block!r} must be "
                                          "[block_n, block_k], e.g. [128, 128]")
        return cls((tuple(positive(b, "weight_block_size", source) for b in block),))

    def companion(self, name: str, tensors: Mapping[str, TensorInfo]) -> Companion | None:
        return scaled_companion(name, tensors, self.blocks, (), "fp8")
