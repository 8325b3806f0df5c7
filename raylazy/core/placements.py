"""How one tensor is divided among tensor-parallel ranks: an open, declarative vocabulary.

A placement answers one question: which slice of the full tensor does rank r of
tp get? The answer is a `Slicing`: the dim being cut, the shard's length along
it, and the pieces (source start, destination start, length) to copy. Rows of
the shard that no piece fills (padding) are zero. Every placement subclasses
`Placement`; registered ones also read from and write to rule-file dicts.
"""

from __future__ import annotations

import functools
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from types import MappingProxyType
from typing import Any, ClassVar, Literal, NamedTuple, get_type_hints

from pydantic import ConfigDict, TypeAdapter, ValidationError

from ..errors import IndivisibleDimError, RuleError, validation_problems

Uneven = Literal["error", "chunk", "pad"]


@dataclass(frozen=True)
class Piece:
    """Copy `length` entries along the split dim from `src` in the full tensor to `dst` in the shard."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class Slicing:
    """Rank r's part of a tensor: `length` entries along `dim`, filled by `pieces` (rest zero)."""

    dim: int
    length: int
    pieces: tuple[Piece, ...]


class ShardContext(NamedTuple):
    """What a placement may consult about one tensor on one rank (immutable). A named tuple: the planner makes
    one per tensor and rank that holds it (97k for DeepSeek-V3 at tp=8 x pp=2), and a frozen dataclass is several
    times slower to build.

    `rank` and `tp` are the rank's tensor-parallel coordinate and the tp size (what
    most placements need); `coords` holds the rank's coordinate along every mesh
    dimension (`raylazy.core.mesh.DIMS`); `name` is the tensor's name (for a quantized
    layer's companion, its weight's: `raylazy.core.quantization`); `expert_parallel`
    and `num_experts` (config.json's) are for `Expert`.
    """

    rank: int
    tp: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    uneven: Uneven = "error"
    name: str = ""
    coords: Mapping[str, int] = MappingProxyType({})
    expert_parallel: bool = False
    num_experts: int | None = None


#: Placement classes by the type name rule files use (`{"type": "split", "dim": -1}`).
PLACEMENT_TYPES: dict[str, type[Placement]] = {}


class Placement(ABC):
    """How one tensor is divided among ranks. The set is open: subclass this (as a frozen dataclass).

    The planner calls `slicing` for every rank, unless `loaded` is False (the
    tensor is left out of the plan). A subclass defined with
    `class Mine(Placement, type_name="mine")` is registered for rule files, which
    build it from its dataclass fields (`{"type": "mine", ...}`).
    """

    #: False: the tensor is not loaded at all (it lands in `Plan.skipped`).
    loaded: ClassVar[bool] = True
    #: The name rule files use for this class; None for a class not registered.
    type_name: ClassVar[str | None] = None

    def __init_subclass__(cls, type_name: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if type_name is not None:
            if type_name in PLACEMENT_TYPES:
                raise RuleError(f"placement type name {type_name!r} is already taken by {PLACEMENT_TYPES[type_name]!r}")
            cls.type_name = type_name
            PLACEMENT_TYPES[type_name] = cls

    @abstractmethod
    def describe(self) -> str:
        """A short label for plans and messages, e.g. `split(dim=-1)`."""

    @abstractmethod
    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing | None:
        """The part of a tensor of `shape` that rank `ctx` gets; None: the whole tensor."""

    def holders(self, shape: tuple[int, ...], ctx: ShardContext) -> tuple[int, ...] | None:
        """The tp ranks that get any of the tensor (e.g. the one holding an expert); None: every tp rank.
        Asked once per tensor and stage: `ctx` is that of the stage's first rank."""
        return None

    def shape_only(self) -> bool:
        """Whether `slicing` answers from the tensor's shape and the rank alone, never from `ctx.name`: the planner
        then asks once per shape, dtype, stage and rank, and gives every tensor alike (a model's layers and
        experts) that answer. False unless a placement says so."""
        return False

    def fused_units(self, ctx: ShardContext) -> int | None:
        """As a part of `Fused`: its size along the fused dim in units (e.g. heads); None: an equal share."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """The rule-file form: `{"type": type_name, field: value...}`, fields at their default left out."""
        if self.type_name is None:
            raise RuleError(f"{self!r} has no type name; define it as class X(Placement, type_name='x')")
        out: dict[str, Any] = {"type": self.type_name}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.default is MISSING or value != f.default:
                out[f.name] = _plain(value)
        return out

    @classmethod
    def from_fields(cls, values: dict[str, Any]) -> Placement:
        """Build from rule-file fields (nested placements already built), each checked (strictly) against its type."""
        checks = _field_checks(cls)
        problems = [f"unknown field {k!r} (fields: {', '.join(checks) or 'none'})" for k in values if k not in checks]
        problems += [f"missing field {f.name!r}" for f in fields(cls)
                     if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
        for k, v in values.items():
            try:
                checks[k].validate_python(v) if k in checks else None
            except ValidationError as e:
                problems.append(validation_problems(e, k))
        if problems:
            raise RuleError(f"{cls.type_name or cls.__name__}: {'; '.join(problems)}")
        return cls(**values)


def placement_from_dict(data: Any) -> Placement:
    """The placement a rule file's `{"type": ..., field: value...}` describes (parts of Fused included)."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise RuleError(f'a placement is an object with a "type" ({", ".join(sorted(PLACEMENT_TYPES))}), got {data!r}')
    cls = PLACEMENT_TYPES.get(data["type"])
    if cls is None:
        raise RuleError(f"unknown placement type {data['type']!r} (known: {', '.join(sorted(PLACEMENT_TYPES))})")
    return cls.from_fields({k: _built(v) for k, v in data.items() if k != "type"})


def _plain(value: Any) -> Any:
    """A field's value in rule-file form: placements as dicts, tuples as lists."""
    if isinstance(value, Placement):
        return value.to_dict()
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _built(value: Any) -> Any:
    """The inverse of `_plain`: dicts as placements, lists as tuples."""
    if isinstance(value, dict):
        return placement_from_dict(value)
    return tuple(_built(v) for v in value) if isinstance(value, list) else value


@functools.cache
def _field_checks(cls: type) -> dict[str, TypeAdapter]:
    """A strict validator of each dataclass field of `cls`, from its type hints."""
    hints = get_type_hints(cls)
    config = ConfigDict(strict=True, arbitrary_types_allowed=True)
    return {f.name: TypeAdapter(hints[f.name], config=config) for f in fields(cls)}


@dataclass(frozen=True)
class Replicated(Placement, type_name="replicated"):
    """Every rank gets the whole tensor (norms, routers, row-parallel biases)."""

    def describe(self) -> str:
        return "replicated"

    def shape_only(self) -> bool:
        return True

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> None:
        return None


@dataclass(frozen=True)
class Skip(Placement, type_name="skip"):
    """The tensor is deliberately not loaded (e.g. a stale `rotary_emb.inv_freq`)."""

    loaded: ClassVar[bool] = False

    def describe(self) -> str:
        return "skip"

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> None:
        return None


@dataclass(frozen=True)
class Split(Placement, type_name="split"):
    """Even split along `dim`: 0 is column-parallel for `[out, in]` weights, -1 row-parallel.

    `uneven` overrides the plan-wide choice for a dim tp does not divide: "error",
    "chunk" (torch.chunk: ceil(n/tp) per rank, the last ranks get less or nothing),
    or "pad" (every rank gets ceil(n'/tp) with n' = n rounded up to `pad_to`; the
    rows past n are zeros, as vLLM pads vocabularies).
    """

    dim: int
    uneven: Uneven | None = None
    pad_to: int = 1

    def describe(self) -> str:
        return f"split(dim={self.dim})"

    def shape_only(self) -> bool:
        return True

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing:
        dim = _norm_dim(self.dim, shape)
        start, length, take = _even(shape[dim], ctx, self.uneven or ctx.uneven, self.pad_to, f"dim {dim}")
        return Slicing(dim, length, (Piece(start, 0, take),) if take else ())


@dataclass(frozen=True)
class Heads(Placement, type_name="heads"):
    """Attention projection split by whole heads along `dim` (0: weights `[out, in]` and biases).

    `kind="q"` splits the query heads evenly. `kind="kv"` splits key/value heads;
    when tp exceeds their count, each head is replicated over tp / num_kv_heads
    consecutive ranks (rank r reads head r // (tp / num_kv_heads)), as inference
    engines do for grouped-query attention. `heads` overrides config.json.
    """

    kind: Literal["q", "kv"]
    heads: int | None = None
    dim: int = 0

    def describe(self) -> str:
        return f"heads({self.kind})" if self.dim == 0 else f"heads({self.kind}, dim={self.dim})"

    def count(self, ctx: ShardContext) -> int:
        """The number of heads: `heads`, else config.json's."""
        heads = self.heads or (ctx.num_heads if self.kind == "q" else ctx.num_kv_heads)
        if not heads:
            raise RuleError(
                f"heads({self.kind}) needs the number of {'attention' if self.kind == 'q' else 'key/value'} heads: "
                "config.json lacks it; pass Heads(kind, heads=N) in your rules"
            )
        return heads

    def fused_units(self, ctx: ShardContext) -> int:
        return self.count(ctx)

    def shape_only(self) -> bool:
        return True

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing:
        dim, heads, tp = _norm_dim(self.dim, shape), self.count(ctx), ctx.tp
        size = shape[dim]
        if size % heads:
            raise RuleError(f"heads({self.kind}): {size} rows are not divisible into {heads} heads")
        head_dim = size // heads
        if self.kind == "kv" and tp > heads:
            if tp % heads:
                raise IndivisibleDimError(
                    f"heads(kv): tp={tp} is neither a divisor nor a multiple of the {heads} key/value heads"
                )
            start, length = (ctx.rank // (tp // heads)) * head_dim, head_dim
        elif heads % tp:
            raise IndivisibleDimError(f"heads({self.kind}): tp={tp} does not divide the {heads} heads")
        else:
            length = heads // tp * head_dim
            start = ctx.rank * length
        return Slicing(dim, length, (Piece(start, 0, length),))


@dataclass(frozen=True)
class Fused(Placement, type_name="fused"):
    """Several logical tensors concatenated along `dim` on disk; each rank takes its slice of each part.

    `parts` lists each part's placement in on-disk order, each splitting `dim`:
    `Heads("q")`, `Heads("kv")` or `Split(dim)`, or any placement that slices
    `dim`. Parts with units (heads) take their size from them; parts without
    share the dim equally. A fused qkv is
    `Fused((Heads("q"), Heads("kv"), Heads("kv")))`, a packed gate_up
    `Fused((Split(0), Split(0)))`.
    """

    parts: tuple[Placement, ...]
    dim: int = 0

    def describe(self) -> str:
        return "fused(" + ", ".join(p.describe() for p in self.parts) + f"; dim={self.dim})"

    def shape_only(self) -> bool:
        return all(p.shape_only() for p in self.parts)

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing:
        dim = _norm_dim(self.dim, shape)
        pieces, src, dst = [], 0, 0
        for part, size in zip(self.parts, self._part_sizes(shape[dim], ctx)):
            sub = part.slicing(shape[:dim] + (size,) + shape[dim + 1 :], ctx)
            if sub is None or sub.dim != dim:
                raise RuleError(f"fused: part {part.describe()} does not split the fused dim {self.dim}; "
                                f"give every part dim={self.dim}")
            pieces += [Piece(src + p.src, dst + p.dst, p.length) for p in sub.pieces]
            src, dst = src + size, dst + sub.length
        return Slicing(dim, dst, tuple(pieces))

    def _part_sizes(self, total: int, ctx: ShardContext) -> list[int]:
        units = [p.fused_units(ctx) for p in self.parts]
        if all(u is None for u in units):
            if total % len(self.parts):
                raise RuleError(f"fused: {total} entries do not split into {len(self.parts)} equal parts")
            return [total // len(self.parts)] * len(self.parts)
        if None in units:
            raise RuleError("fused: mix of head parts and split parts is ambiguous; give each part's heads")
        if total % sum(units):
            raise RuleError(f"fused: {total} rows are not divisible into {sum(units)} heads")
        return [u * (total // sum(units)) for u in units]


#: `experts.<e>.` at the start of a name or after a dot: spelled to begin with the literal (the start or the dot
#: is the look-behind), which the regular expression engine finds by a fast scan, twice as fast as `(?:^|\.)`.
_EXPERT = re.compile(r"experts\.(?<![^.]experts\.)(\d+)\.")


@dataclass(frozen=True)
class Expert(Placement, type_name="expert"):
    """A routed MoE expert's tensor: sharded by `placement` over the tp ranks, unless the plan is expert-parallel:
    then whole experts go to the tp ranks in contiguous blocks (`expert_block`, vLLM's linear expert map: rank r
    of tp gets experts [r*E/tp, (r+1)*E/tp), the first E % tp ranks one more when tp does not divide E).

    `dim` None: one expert per tensor, its number after `experts.` in the name (`...experts.7.w1.weight`), held
    whole by its rank only. `dim` d: experts fused along dim d of one tensor (`[E, 2I, H]`), each rank
    reading its block of them. `experts` overrides the expert count (config.json's, or a fused tensor's dim).
    """

    placement: Placement
    dim: int | None = None
    experts: int | None = None

    def describe(self) -> str:
        inner = self.placement.describe()
        return f"expert({inner})" if self.dim is None else f"expert({inner}; dim={self.dim})"

    def shape_only(self) -> bool:  # `holders` reads the name; `slicing` does not
        return self.placement.shape_only()

    def holders(self, shape: tuple[int, ...], ctx: ShardContext) -> tuple[int, ...] | None:
        if not ctx.expert_parallel or self.dim is not None:
            return None
        count = self.count(ctx)
        return _holder(expert_index(ctx.name, count), ctx.tp, count)

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing | None:
        if not ctx.expert_parallel:
            return self.placement.slicing(shape, ctx)
        if self.dim is None:
            return None
        dim = _norm_dim(self.dim, shape)
        if self.experts not in (None, shape[dim]):
            raise RuleError(f"expert: dim {dim} holds {shape[dim]} experts, not the {self.experts} given")
        start, n = expert_block(ctx.rank, ctx.tp, shape[dim])
        return Slicing(dim, n, (Piece(start, 0, n),) if n else ())

    def count(self, ctx: ShardContext) -> int:
        """The number of experts of a per-expert tensor: `experts`, else config.json's."""
        n = self.experts or ctx.num_experts
        if not n:
            raise RuleError("expert: the number of experts is unknown: config.json has no num_local_experts, "
                            "num_experts or n_routed_experts; pass Expert(placement, experts=N) in your rules")
        return n


def expert_index(name: str, count: int) -> int:
    """The expert a per-expert tensor's name holds (the number after `experts.`), checked against the count."""
    m = _EXPERT.search(name)
    if m is None:
        raise RuleError(f"expert: {name!r} names no expert ('experts.<e>.'); for experts fused in one tensor "
                        "give the expert dim: Expert(placement, dim=0)")
    e = int(m.group(1))
    if e >= count:
        raise RuleError(f"expert: {name!r} is expert {e}, but the model has {count} experts (0-{count - 1})")
    return e


def expert_block(rank: int, ranks: int, experts: int) -> tuple[int, int]:
    """(first expert, count) of rank `rank` of `ranks`: contiguous blocks of experts // ranks, the first
    experts % ranks ranks one more (vLLM's `determine_expert_map`, linear placement)."""
    base, extra = divmod(experts, ranks)
    return rank * base + min(rank, extra), base + (rank < extra)


def expert_owner(expert: int, ranks: int, experts: int) -> int:
    """The rank whose `expert_block` holds `expert`."""
    base, extra = divmod(experts, ranks)
    big = extra * (base + 1)  # experts held by the first `extra` ranks, one more each
    return expert // (base + 1) if expert < big else extra + (expert - big) // base


@functools.lru_cache(maxsize=4096)
def _holder(expert: int, ranks: int, experts: int) -> tuple[int]:
    """`Expert.holders`' answer for `expert` of `experts` over `ranks`: (its `expert_owner`,), made once."""
    return (expert_owner(expert, ranks, experts),)


def _norm_dim(dim: int, shape: tuple[int, ...]) -> int:
    if not -len(shape) <= dim < len(shape):
        raise RuleError(f"dim {dim} is out of range for a tensor of shape {list(shape)}")
    return dim % len(shape)


def _even(n: int, ctx: ShardContext, uneven: Uneven, pad_to: int, what: str) -> tuple[int, int, int]:
    """(source start, shard length, entries taken from the source) for rank ctx.rank."""
    tp, r = ctx.tp, ctx.rank
    if uneven == "pad":
        padded = -(-n // pad_to) * pad_to
        per = -(-padded // tp)
    elif n % tp == 0:
        per = n // tp
    elif uneven == "chunk":
        per = -(-n // tp)
    else:
        raise IndivisibleDimError(
            f"{what} of size {n} is not divisible by tp={tp}; choose a tp that divides it, "
            "or pass uneven='chunk' (torch.chunk semantics) or uneven='pad' (zero padding)"
        )
    start = min(r * per, n)
    take = min(per, n - start)
    length = per if uneven == "pad" else take
    return start, length, take
