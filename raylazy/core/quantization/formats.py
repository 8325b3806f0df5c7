"""What every quantization format shares: the registry of formats by config.json's `quant_method`, finding each
quantized layer's tensors by name, and checking a companion's shape against its weight's grid.

A format reads its part of `quantization_config` (`from_config`) and says, for a tensor name, whether it is a
companion of a weight and how it lies (`companion`). Layouts are spelled as specs, one entry per companion dim:
an `Axis` (the dim runs along that weight dim, one entry per `unit`: its size is ceil(weight dim / unit)), an
int (a dim of the companion's own, of that size: a broadcast 1, MXFP4's 16 bytes per block), or None (of its own,
any size).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from ...errors import QuantizationConfigError, QuantizedLayoutError, UnsupportedQuantizationError
from ..header import TensorInfo
from .placing import Axis, Companion, Layout

Spec = tuple[Axis | int | None, ...]

#: Format classes by the `quant_method` they read.
FORMATS: dict[str, type[Format]] = {}


class Format(ABC):
    """A quantization format: which tensors of a checkpoint are companions of which weight, and how each lies."""

    #: How every companion's name ends (None: any name may be one): a first sieve, in C, over ~10^5 names.
    suffixes: ClassVar[tuple[str, ...] | None] = None

    def __init_subclass__(cls, methods: Sequence[str] = (), **kwargs):
        super().__init_subclass__(**kwargs)
        for m in methods:
            FORMATS[m] = cls

    @classmethod
    @abstractmethod
    def from_config(cls, raw: Mapping[str, Any], source: str) -> Format:
        """The format `quantization_config` `raw` describes (a QuantizationConfigError naming `source` otherwise)."""

    @abstractmethod
    def companion(self, name: str, tensors: Mapping[str, TensorInfo]) -> Companion | None:
        """Tensor `name`'s weight and layout if it is a companion (None: a plain tensor, placed by the rules)."""

    def companions(self, tensors: Mapping[str, TensorInfo]) -> dict[str, Companion]:
        """Every companion tensor of the checkpoint (`tensors`: name -> TensorInfo) with its weight and layout."""
        out = {}
        ends = self.suffixes
        for name in tensors if ends is None else [n for n in tensors if n.endswith(ends)]:
            c = self.companion(name, tensors)
            if c is not None:
                out[name] = c
        return out


def parse_quantization(raw: Any, source: str = "config.json") -> Format | None:
    """The Format of config.json's `quantization_config` `raw` (None: the checkpoint is not quantized)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("quant_method"), str):
        raise QuantizationConfigError(f"{source}: quantization_config must be an object with a quant_method string, "
                                      f"got {raw!r:.200}")
    method = raw["quant_method"]
    cls = FORMATS.get(method)
    return Unsupported(method) if cls is None else cls.from_config(raw, source)


class Unsupported(Format):
    """A `quant_method` raylazy does not know: planning it is an error (its scales would be placed by name)."""

    def __init__(self, method: str):
        self.method = method  # quant_method as config.json spells it

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], source: str) -> Format:
        return cls(raw["quant_method"])

    def companion(self, name: str, tensors: Mapping[str, TensorInfo]) -> Companion | None:
        raise UnsupportedQuantizationError(
            f"config.json's quantization_config has quant_method {self.method!r}, which raylazy cannot shard (it "
            f"plans {', '.join(sorted(FORMATS))}); its scale and packed tensors would be placed by their names alone")


def field(raw: Mapping[str, Any], key: str, source: str, kind: type | tuple, default: Any = None) -> Any:
    """`raw[key]` checked to be of `kind` (bool is not an int here), or `default` when absent or null."""
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise QuantizationConfigError(f"{source}: quantization_config {key}={value!r} is not "
                                      f"{getattr(kind, '__name__', kind)}")
    return value


def positive(value: Any, what: str, source: str) -> int:
    """`value` as a positive int (a QuantizationConfigError naming `what` otherwise)."""
    if type(value) is not int or value <= 0:
        raise QuantizationConfigError(f"{source}: quantization_config {what}={value!r} must be a positive integer")
    return value


@functools.lru_cache(maxsize=4096)
def grid(shape: tuple[int, ...], weight: tuple[int, ...], spec: Spec, role: str) -> Layout | None:
    """The layout of a companion of `shape` beside a weight of shape `weight` if `spec` fits its shape, else None.
    Cached: a checkpoint has a few dozen distinct (shape, weight, spec), repeated over its layers and experts."""
    if len(shape) != len(spec):
        return None
    for size, s in zip(shape, spec):
        want = -(-weight[s.dim] // s.unit) if isinstance(s, Axis) else s
        if want is not None and size != want:
            return None
    return Layout(weight, tuple(s if isinstance(s, Axis) else None for s in spec), role)


def first_fit(shape: tuple[int, ...], wshape: tuple[int, ...], specs: Sequence[tuple[Spec, str]]) -> Layout | None:
    """The layout of the first of `specs` ((spec, role) pairs) that a companion of `shape` fits, if any."""
    return next((layout for spec, role in specs if (layout := grid(shape, wshape, spec, role)) is not None), None)


def fit(name: str, t: TensorInfo, weight: str, wshape: tuple[int, ...], specs: Sequence[tuple[Spec, str]],
        what: str) -> Companion:
    """The companion `t` (tensor `name`) of weight `weight` of shape `wshape`: the first of `specs` ((spec, role)
    pairs) its shape fits; none: a QuantizedLayoutError saying what was expected (`what`: the format)."""
    layout = first_fit(t.shape, wshape, specs)
    if layout is not None:
        return Companion(weight, layout)
    expected = "; ".join(f"{role} {_expected(spec, wshape)}" for spec, role in specs)
    raise QuantizedLayoutError(f"tensor {name!r} {list(t.shape)} does not lie as a {what} companion of {weight!r} "
                               f"{list(wshape)} can: expected {expected} (check quantization_config's block and "
                               "group sizes and bits against the checkpoint)")


def _expected(spec: Spec, wshape: tuple[int, ...]) -> str:
    dims = [str(-(-wshape[s.dim] // s.unit)) if isinstance(s, Axis) else "*" if s is None else str(s) for s in spec]
    return f"[{', '.join(dims)}]"


def whole(rank: int) -> Spec:
    """The spec of a companion of `rank` dims that follows no dim of its weight (a scalar, `weight_shape`)."""
    return (None,) * rank
