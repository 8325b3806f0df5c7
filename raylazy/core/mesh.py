"""The device mesh: named parallel dimensions, the world size, and each rank's coordinates.

Ranks are numbered row-major over `DIMS` (outermost first): replicas, then pipeline
stages, then tensor-parallel ranks, so `tp` varies fastest. With `Mesh(pp=2, tp=4)`
ranks 0-3 form the first pipeline stage; with `Mesh(dp=2, pp=2, tp=4)` ranks 0-7 are
the first replica's whole stage grid. Expert parallelism is not a dimension: as in
vLLM, experts are spread over the tp ranks of a stage (a planning option).
"""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigurationError

#: The dimensions a mesh may name, outermost first: data-parallel replicas, pipeline stages,
#: tensor parallel.
DIMS = ("dp", "pp", "tp")


class Coord(NamedTuple):
    """One global rank's place in the mesh: its replica, pipeline stage and tensor-parallel rank."""

    rank: int
    replica: int
    stage: int
    tp_rank: int


class Mesh(BaseModel):
    """Sizes of the parallel dimensions (each >= 1, default 1), e.g. `Mesh(tp=8)`.

    A bad size is a `ConfigurationError` naming the dimension.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    dp: int = Field(1, ge=1, le=4096)
    pp: int = Field(1, ge=1, le=4096)
    tp: int = Field(1, ge=1, le=4096)

    def __init__(self, **dims: int):
        try:
            super().__init__(**dims)
        except ValidationError as e:
            raise ConfigurationError.from_validation(e, f"mesh (dimensions: {', '.join(DIMS)})") from None

    @property
    def shape(self) -> dict[str, int]:
        """Every dimension's size, outermost first."""
        return {d: getattr(self, d) for d in DIMS}

    @property
    def size(self) -> int:
        """The world size: the number of ranks."""
        n = 1
        for d in DIMS:
            n *= getattr(self, d)
        return n

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its coordinate along every dimension."""
        if not 0 <= rank < self.size:
            raise ConfigurationError(f"rank {rank} is outside a mesh of {self.size} rank(s) ({self})")
        out = {}
        for d in reversed(DIMS):
            rank, out[d] = divmod(rank, getattr(self, d))
        return {d: out[d] for d in DIMS}

    def coord(self, rank: int) -> Coord:
        """Rank -> its `Coord` (replica, stage, tp_rank)."""
        c = self.coords(rank)
        return Coord(rank, c["dp"], c["pp"], c["tp"])

    def rank(self, **coords: int) -> int:
        """Coordinates (missing ones are 0) -> the rank."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise ConfigurationError(f"no mesh dimension {', '.join(sorted(unknown))} (dimensions: {', '.join(DIMS)})")
        rank = 0
        for d in DIMS:
            c, n = coords.get(d, 0), getattr(self, d)
            if not 0 <= c < n:
                raise ConfigurationError(f"coordinate {d}={c} is outside the mesh's {d}={n}")
            rank = rank * n + c
        return rank

    def __repr__(self) -> str:
        dims = [f"{d}={n}" for d, n in self.shape.items() if n > 1]
        return f"Mesh({', '.join(dims) or 'tp=1'})"

    __str__ = __repr__
