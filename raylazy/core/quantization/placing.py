"""How a quantized weight's companion tensors (scales, zero points, packed codes, group indices) follow the
placement of the weight they belong to, each at its own granularity.

The rules place the logical weight, named and shaped as a dense checkpoint holds it (`...q_proj.weight`
`[N, K]`); a companion says, for each of its dims, which dim of that weight it runs along and how many of the
weight's entries one of its entries covers (a 128x128 FP8 block scale covers 128 along both; GPTQ's int32
`qweight` `[K/8, N]` covers 8 input columns per entry). The weight's slice, in the weight's own units, is
turned into the companion's: pieces divided by the unit. A piece that starts or ends inside a unit (other than
at the weight's end, where the last block is partial) is a QuantizedSplitError, never a wrong shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ...errors import QuantizedSplitError
from ..placements import Piece, Placement, ShardContext, Slicing


class Axis(NamedTuple):
    """A companion dim that runs along dim `dim` of its weight, one entry per `unit` of the weight's entries
    (`grain` names the unit in messages: "scale block", "group", "int32 word of 8 codes")."""

    dim: int
    unit: int = 1
    grain: str = ""


class Layout(NamedTuple):
    """How a companion of a weight of `shape` lies: `axes[i]` is the weight dim its dim i follows, or None (a dim
    of its own, or broadcast: the companion is whole along it). `role` names it in plans ("block scale")."""

    shape: tuple[int, ...]
    axes: tuple[Axis | None, ...]
    role: str


class Companion(NamedTuple):
    """A tensor of a quantized layer: the logical weight it follows (its name as rules name it) and its layout."""

    weight: str
    layout: Layout


@dataclass(frozen=True)
class Following(Placement):
    """A companion placed as `placement` places its weight, at the companion's granularity (`layout`)."""

    placement: Placement
    layout: Layout

    def describe(self) -> str:
        return f"{self.placement.describe()}, {self.layout.role}"

    def holders(self, shape: tuple[int, ...], ctx: ShardContext) -> tuple[int, ...] | None:
        return self.placement.holders(self.layout.shape, ctx)

    def shape_only(self) -> bool:
        return self.placement.shape_only()

    def slicing(self, shape: tuple[int, ...], ctx: ShardContext) -> Slicing | None:
        weight = self.placement.slicing(self.layout.shape, ctx)
        if weight is None:
            return None
        dim = next((i for i, a in enumerate(self.layout.axes) if a is not None and a.dim == weight.dim), None)
        if dim is None:  # the companion does not run along the split dim: every rank needs all of it
            return None
        axis = self.layout.axes[dim]
        if axis.unit == 1:
            return Slicing(dim, weight.length, weight.pieces)
        return _coarsen(weight, axis, self.layout.shape[weight.dim], dim, ctx)


def _coarsen(weight: Slicing, axis: Axis, full: int, dim: int, ctx: ShardContext) -> Slicing:
    """The weight's slicing along a dim of `full` entries, in units of `axis.unit` along companion dim `dim`."""
    unit, pieces = axis.unit, []
    for p in weight.pieces:
        end = p.src + p.length
        if p.src % unit or p.dst % unit or (end % unit and end != full):
            _cut(axis, full, p.src, end, ctx)
        pieces.append(Piece(p.src // unit, p.dst // unit, -(-end // unit) - p.src // unit))
    last = weight.pieces[-1] if weight.pieces else None
    if weight.length % unit and not (last and last.src + last.length == full and last.dst + last.length == weight.length):
        _cut(axis, full, weight.length, weight.length, ctx)
    return Slicing(dim, -(-weight.length // unit), tuple(pieces))


def _cut(axis: Axis, full: int, start: int, end: int, ctx: ShardContext) -> None:
    raise QuantizedSplitError(
        f"rank {ctx.rank} of tp={ctx.tp} would get entries [{start}, {end}) of its weight's dim {axis.dim} "
        f"({full} entries), which cuts inside a {axis.grain} of {axis.unit}: each entry of this tensor covers "
        f"{axis.unit} of them. Choose a tp whose slices are whole multiples of {axis.unit} (or expert_parallel=True "
        "for experts), or replicate the layer with a rule"
    )
