"""How one tensor is divided among tensor-parallel ranks: a small declarative vocabulary.

A placement answers one question: which slice of the full tensor does rank r of
tp get? The answer is a `Slicing`: the dim being cut, the shard's length along
it, and the pieces (source start, destination start, length) to copy. Rows of
the shard that no piece fills (padding) are zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from .errors import IndivisibleDimError, RuleError

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


@dataclass(frozen=True)
class ShardContext:
    """What a placement may consult: the rank, the world size, the model's head counts."""

    rank: int
    tp: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    uneven: Uneven = "error"


@dataclass(frozen=True)
class Replicated:
    """Every rank gets the whole tensor (norms, routers, row-parallel biases)."""

    def describe(self) -> str:
        return "replicated"


@dataclass(frozen=True)
class Skip:
    """The tensor is deliberately not loaded (e.g. a stale `rotary_emb.inv_freq`)."""

    def describe(self) -> str:
        return "skip"


@dataclass(frozen=True)
class Split:
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

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing:
        dim = _norm_dim(self.dim, shape)
        start, length, take = _even(shape[dim], ctx, self.uneven or ctx.uneven, self.pad_to, f"dim {dim}")
        return Slicing(dim, length, (Piece(start, 0, take),) if take else ())


@dataclass(frozen=True)
class Heads:
    """Attention projection split by whole heads along dim 0 (weights and biases).

    `kind="q"` splits the query heads evenly. `kind="kv"` splits key/value heads;
    when tp exceeds their count, each head is replicated over tp / num_kv_heads
    consecutive ranks (rank r reads head r // (tp / num_kv_heads)), as inference
    engines do for grouped-query attention. `heads` overrides config.json.
    """

    kind: Literal["q", "kv"]
    heads: int | None = None

    def describe(self) -> str:
        return f"heads({self.kind})"

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing:
        start, length = self._rows(shape[0], ctx)
        return Slicing(0, length, (Piece(start, 0, length),))

    def _rows(self, size: int, ctx: ShardContext) -> tuple[int, int]:
        heads = self.heads or (ctx.num_heads if self.kind == "q" else ctx.num_kv_heads)
        if not heads:
            raise RuleError(
                f"heads({self.kind}) needs the number of {'attention' if self.kind == 'q' else 'key/value'} heads: "
                "config.json lacks it; pass Heads(kind, heads=N) in your rules"
            )
        if size % heads:
            raise RuleError(f"heads({self.kind}): {size} rows are not divisible into {heads} heads")
        head_dim, tp = size // heads, ctx.tp
        if self.kind == "kv" and tp > heads:
            if tp % heads:
                raise IndivisibleDimError(
                    f"heads(kv): tp={tp} is neither a divisor nor a multiple of the {heads} key/value heads"
                )
            return (ctx.rank // (tp // heads)) * head_dim, head_dim
        if heads % tp:
            raise IndivisibleDimError(f"heads({self.kind}): tp={tp} does not divide the {heads} heads")
        per = heads // tp
        return ctx.rank * per * head_dim, per * head_dim


@dataclass(frozen=True)
class Fused:
    """Several logical tensors concatenated along `dim` on disk; each rank takes its slice of each part.

    `parts` lists each part's placement in on-disk order: `Heads("q")`, `Heads("kv")`
    or `Split(dim)` (same dim). Head parts take their size from the head count;
    Split parts share the rest equally. A fused qkv is
    `Fused((Heads("q"), Heads("kv"), Heads("kv")))`, a packed gate_up
    `Fused((Split(0), Split(0)))`.
    """

    parts: tuple[Union[Heads, Split], ...]
    dim: int = 0

    def describe(self) -> str:
        return "fused(" + ", ".join(p.describe() for p in self.parts) + f"; dim={self.dim})"

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing:
        dim = _norm_dim(self.dim, shape)
        sizes = self._part_sizes(shape[dim], ctx)
        pieces, src, dst = [], 0, 0
        for part, size in zip(self.parts, sizes):
            if isinstance(part, Split) and _norm_dim(part.dim, shape) != dim:
                raise RuleError(f"fused: part {part.describe()} does not split the fused dim {self.dim}; "
                                f"give every Split part dim={self.dim}")
            sub = part.slicing(shape[:dim] + (size,) + shape[dim + 1 :], ctx) if isinstance(part, Split) else None
            if sub is None:
                start, length = part._rows(size, ctx)
                sub = Slicing(dim, length, (Piece(start, 0, length),))
            pieces += [Piece(src + p.src, dst + p.dst, p.length) for p in sub.pieces]
            src, dst = src + size, dst + sub.length
        return Slicing(dim, dst, tuple(pieces))

    def _part_sizes(self, total: int, ctx: ShardContext) -> list[int]:
        head_dim = None
        heads_of = {"q": ctx.num_heads, "kv": ctx.num_kv_heads}
        head_parts = [p for p in self.parts if isinstance(p, Heads)]
        split_parts = [p for p in self.parts if isinstance(p, Split)]
        if head_parts:
            all_heads = sum(p.heads or heads_of[p.kind] or 0 for p in head_parts)
            if not all(p.heads or heads_of[p.kind] for p in head_parts):
                raise RuleError("fused: head parts need head counts from config.json or Heads(kind, heads=N)")
            if split_parts:
                raise RuleError("fused: mix of head parts and split parts is ambiguous; give each part's heads")
            if total % all_heads:
                raise RuleError(f"fused: {total} rows are not divisible into {all_heads} heads")
            head_dim = total // all_heads
            return [(p.heads or heads_of[p.kind]) * head_dim for p in head_parts]
        if total % len(self.parts):
            raise RuleError(f"fused: {total} entries do not split into {len(self.parts)} equal parts")
        return [total // len(self.parts)] * len(self.parts)


Placement = Union[Replicated, Skip, Split, Heads, Fused]


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
