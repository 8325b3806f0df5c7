"""Integer codes packed into int32 words, with scales and zero points per group of input columns: GPTQ
(`qweight` `[K/8, N]` packed along the input, `qzeros` `[K/g, N/8]`, `scales` `[K/g, N]`, `g_idx` `[K]`), AWQ
(`qweight` `[K, N/8]` packed along the output, `qzeros` `[K/g, N/8]`, `scales` `[K/g, N]`) and compressed-tensors'
pack-quantized layers (`weight_packed` `[N, K/8]`, `weight_scale` `[N, K/g]`, `weight_zero_point` `[N/8, K/g]`,
`weight_g_idx` `[K]`, `weight_shape`), each following its logical weight `P.weight` `[N, K]`.

With act-order (GPTQ's `desc_act`, compressed-tensors' `weight_g_idx`) the input columns are quantized in a
permuted order, so a group's columns are spread over the whole input: a row-parallel rank needs every group's
scales and zeros, which then are whole on every rank (as vLLM keeps them); `g_idx` is split with the columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import QuantizedLayoutError, UnsupportedQuantizationError
from ..header import TensorInfo
from .formats import Format, Spec, field, fit, positive, whole
from .placing import Axis, Companion

N, K = 0, 1  # the logical weight's dims: [out, in]


def word(bits: int) -> tuple[int, str]:
    """(codes per int32 word, the word as messages name it) for `bits`-bit codes."""
    if bits not in (2, 4, 8):
        raise UnsupportedQuantizationError(f"{bits}-bit codes: raylazy shards 2-, 4- and 8-bit codes packed in int32 "
                                           "words (3-bit codes straddle words)")
    return 32 // bits, f"int32 word of {32 // bits} {bits}-bit codes"


def groups_along_k(wshape: tuple[int, ...], group: int | None, act_order: bool) -> Axis | int:
    """The spec of a scale's dim over the input's groups: one per `group` columns, split with them; whole (one
    entry per group, every rank all of them) with act-order; one entry with no groups (per channel)."""
    if group is None:
        return 1
    return -(-wshape[K] // group) if act_order else Axis(K, group, "quantization group")


def _anchored(name: str, tensors: Mapping[str, TensorInfo], suffixes: Sequence[str],
              anchor: str) -> tuple[str, TensorInfo] | None:
    """(suffix, anchor tensor) if `name` is `P.<suffix>` and `P.<anchor>` (2-D) is on disk, else None."""
    prefix, _, suffix = name.rpartition(".")
    if suffix not in suffixes:
        return None
    a = tensors.get(f"{prefix}.{anchor}")
    if a is None:
        return None
    if len(a.shape) != 2 or a.dtype != "I32":
        raise QuantizedLayoutError(f"tensor {a.name!r} is {a.dtype} {list(a.shape)}: packed codes are a 2-D int32 "
                                   "tensor")
    return suffix, a


def _group(raw: Mapping[str, Any], source: str, key: str = "group_size") -> int | None:
    g = field(raw, key, source, int, -1)
    return None if g == -1 else positive(g, key, source)


@dataclass(frozen=True)
class Gptq(Format, methods=("gptq",)):
    """GPTQ: `bits`-bit codes packed along the input, scales per `group` input columns (None: per channel)."""

    suffixes = (".qweight", ".qzeros", ".scales", ".g_idx")

    bits: int = 4
    group: int | None = 128
    act_order: bool = False

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], source: str) -> Gptq:
        fmt = field(raw, "checkpoint_format", source, str, "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantizationError(f"{source}: GPTQ checkpoint_format {fmt!r}: raylazy shards the gptq "
                                               "and gptq_v2 layouts")
        bits = positive(field(raw, "bits", source, int, 4), "bits", source)
        word(bits)
        return cls(bits, _group(raw, source), field(raw, "desc_act", source, bool, False))

    def companion(self, name: str, tensors: Mapping[str, TensorInfo]) -> Companion | None:
        found = _anchored(name, tensors, ("qweight", "qzeros", "scales", "g_idx"), "qweight")
        if found is None:
            return None
        suffix, q = found
        per, grain = word(self.bits)
        wshape = (q.shape[1], q.shape[0] * per)
        groups = groups_along_k(wshape, self.group, self.act_order)
        spec: Spec = {"qweight": (Axis(K, per, grain), Axis(N)), "qzeros": (groups, Axis(N, per, grain)),
                      "scales": (groups, Axis(N)), "g_idx": (Axis(K),)}[suffix]
        role = {"qweight": "packed codes", "qzeros": "packed zero points", "scales": "group scales",
                "g_idx": "group index"}[suffix]
        return fit(name, tensors[name], name.rpartition(".")[0] + ".weight", wshape, [(spec, role)], "GPTQ")


@dataclass(frozen=True)
class Awq(Format, methods=("awq",)):
    """AWQ (GEMM layout): `bits`-bit codes packed along the output, scales per `group` input columns."""

    suffixes = (".qweight", ".qzeros", ".scales")

    bits: int = 4
    group: int | None = 128

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], source: str) -> Awq:
        version = field(raw, "version", source, str, "gemm").lower()
        if version != "gemm":
            raise UnsupportedQuantizationError(f"{source}: AWQ version {version!r}: raylazy shards the GEMM layout "
                                               "(qweight [K, N/8]), as vLLM's awq does")
        bits = positive(field(raw, "bits", source, int, None) or field(raw, "w_bit", source, int, 4), "bits", source)
        word(bits)
        group = _group(raw, source, "group_size" if "group_size" in raw else "q_group_size")
        return cls(bits, group)

    def companion(self, name: str, tensors: Mapping[str, TensorInfo]) -> Companion | None:
        found = _anchored(name, tensors, ("qweight", "qzeros", "scales"), "qweight")
        if found is None:
            return None
        suffix, q = found
        per, grain = word(self.bits)
        wshape = (q.shape[1] * per, q.shape[0])
        groups = groups_along_k(wshape, self.group, False)
        spec: Spec = {"qweight": (Axis(K), Axis(N, per, grain)), "qzeros": (groups, Axis(N, per, grain)),
                      "scales": (groups, Axis(N))}[suffix]
        role = {"qweight": "packed codes", "qzeros": "packed zero points", "scales": "group scales"}[suffix]
        return fit(name, tensors[name], name.rpartition(".")[0] + ".weight", wshape, [(spec, role)], "AWQ")


def pack_quantized(name: str, tensors: Mapping[str, TensorInfo], bits: Sequence[int],
                   groups: Sequence[int]) -> Companion | None:
    """`name` as a compressed-tensors pack-quantized companion (`P.weight_packed` int32 on disk), or None."""
    found = _anchored(name, tensors, ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx",
                                      "weight_shape"), "weight_packed")
    if found is None:
        return None
    suffix, packed = found
    if len(bits) != 1:
        raise QuantizedLayoutError(f"tensor {packed.name!r}: quantization_config's pack-quantized groups give "
                                   f"{len(bits) or 'no'} int bit widths ({sorted(bits)}), so the packing of its "
                                   "int32 words is unknown")
    per, grain = word(bits[0])
    wshape = (packed.shape[0], packed.shape[1] * per)
    act_order = f"{name.rpartition('.')[0]}.weight_g_idx" in tensors
    by_group = [groups_along_k(wshape, g, act_order) for g in groups] + [groups_along_k(wshape, None, False)]
    specs: list[tuple[Spec, str]] = {
        "weight_packed": [((Axis(N), Axis(K, per, grain)), "packed codes")],
        "weight_scale": [((Axis(N), g), "group scales") for g in by_group] + [(whole(1), "per-tensor scale")],
        "weight_zero_point": [((Axis(N, per, grain), g), "packed zero points") for g in by_group]
        + [(whole(1), "per-tensor zero point")],
        "weight_g_idx": [((Axis(K),), "group index")],
        "weight_shape": [(whole(1), "shape")],
    }[suffix]
    return fit(name, tensors[name], name.rpartition(".")[0] + ".weight", wshape, specs, "compressed-tensors pack-quantized")

