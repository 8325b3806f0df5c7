"""The load plan: immutable, picklable data saying which bytes each rank reads and where they go.

A `Read` is a run of `count` equal-sized byte ranges in one file, `stride` bytes
apart, that land `dst_stride` bytes apart in the shard's buffer: one range for a
dim-0 slice, one range per row for a slice of the last dim. With `gather`, the
reader fetches the whole span (gaps included) in one request and keeps the rows.
"""

from __future__ import annotations

import os
from typing import Optional

from pydantic import BaseModel, ConfigDict, ValidationError

from .dtypes import DTYPE_BITS
from .errors import PlanFormatError
from .mesh import Mesh


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileRef(_Frozen):
    """A checkpoint file as planned: URI (a plain path for a local file), size and header digest
    (checked again before reading)."""

    uri: str
    size: int
    digest: str


class Read(_Frozen):
    """`count` ranges of `length` bytes at file[offset + i*stride] -> shard[dst_offset + i*dst_stride]."""

    file: int
    offset: int
    length: int
    dst_offset: int
    count: int = 1
    stride: int = 0
    dst_stride: int = 0
    gather: bool = False

    @property
    def span(self) -> int:
        """Bytes from the first byte of the first range to the last byte of the last."""
        return (self.count - 1) * self.stride + self.length

    @property
    def bytes_needed(self) -> int:
        return self.count * self.length

    @property
    def bytes_read(self) -> int:
        return self.span if self.gather else self.bytes_needed

    @property
    def requests(self) -> int:
        return 1 if self.gather else self.count


class TensorShard(_Frozen):
    """One tensor as one rank gets it.

    The shard has `shape`; along `dim`, each piece `(src, dst, length)` copies entries
    `[src, src+length)` of the full tensor to `[dst, dst+length)` of the shard, and
    entries no piece covers are zero (padding). `dim` is None for a whole tensor.
    The full tensor's bytes start at `offset` of file `file`.
    """

    name: str
    file: int
    offset: int
    dtype: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    placement: str
    dim: Optional[int]
    pieces: tuple[tuple[int, int, int], ...]
    reads: tuple[Read, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * DTYPE_BITS[self.dtype] // 8

    @property
    def bytes_needed(self) -> int:
        return sum(r.bytes_needed for r in self.reads)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.reads)

    @property
    def requests(self) -> int:
        return sum(r.requests for r in self.reads)


class RankStats(_Frozen):
    """What one rank loads: bytes its shards need, bytes it reads, requests and files."""

    tensors: int
    shard_bytes: int
    bytes_needed: int
    bytes_read: int
    requests: int
    files: int


class RankPlan(_Frozen):
    """Everything one rank's actor needs: the files and its tensors' reads, and where it sits in the mesh."""

    rank: int
    mesh: Mesh
    files: tuple[FileRef, ...]
    tensors: tuple[TensorShard, ...]

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def coords(self) -> dict[str, int]:
        """The rank's coordinate along every mesh dimension."""
        return self.mesh.coords(self.rank)

    @property
    def stats(self) -> RankStats:
        return RankStats(
            tensors=len(self.tensors),
            shard_bytes=sum(t.nbytes for t in self.tensors),
            bytes_needed=sum(t.bytes_needed for t in self.tensors),
            bytes_read=sum(t.bytes_read for t in self.tensors),
            requests=sum(t.requests for t in self.tensors),
            files=len({r.file for t in self.tensors for r in t.reads}),
        )


class Plan(_Frozen):
    """The whole load: one RankPlan per rank, plus what was planned from and skipped."""

    root: str
    model_type: Optional[str]
    mesh: Mesh
    max_gap: int
    uneven: str
    checkpoint_bytes: int
    files: tuple[FileRef, ...]
    skipped: tuple[str, ...]
    ranks: tuple[RankPlan, ...]

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def bytes_needed(self) -> int:
        return sum(r.stats.bytes_needed for r in self.ranks)

    @property
    def bytes_read(self) -> int:
        return sum(r.stats.bytes_read for r in self.ranks)

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise PlanFormatError(f"not a raylazy plan: {e}") from None

    def to_rows(self) -> list[dict]:
        """One dict per rank x tensor x read (a tensor with no reads, e.g. empty, gets one row)."""
        rows = []
        for rp in self.ranks:
            for t in rp.tensors:
                base = {"rank": rp.rank, "tensor": t.name, "placement": t.placement, "dtype": t.dtype,
                        "shape": t.shape, "full_shape": t.full_shape}
                for r in t.reads or (None,):
                    rows.append({
                        **base,
                        "file": os.path.basename(self.files[r.file].uri) if r else None,
                        "offset": r.offset if r else None,
                        "length": r.length if r else 0,
                        "count": r.count if r else 0,
                        "stride": r.stride if r else 0,
                        "bytes_needed": r.bytes_needed if r else 0,
                        "bytes_read": r.bytes_read if r else 0,
                        "requests": r.requests if r else 0,
                    })
        return rows

    def to_table(self):
        """The rows of `to_rows` as a pandas DataFrame (needs pandas: `pip install raylazy[notebook]`)."""
        import pandas as pd

        return pd.DataFrame(self.to_rows())

    def summary(self) -> str:
        """A per-rank table of bytes, requests and files, as `raylazy plan` prints it."""
        naive = self.checkpoint_bytes
        lines = [
            f"plan: {self.root} ({self.model_type or 'unknown model type'}), tp={self.tp}, "
            f"{len(self.files)} file(s), {format_bytes(naive)} in the checkpoint",
            f"{'rank':>4} {'tensors':>8} {'needed':>11} {'read':>11} {'requests':>9} {'files':>5}",
        ]
        for rp in self.ranks:
            s = rp.stats
            lines.append(
                f"{rp.rank:>4} {s.tensors:>8} {format_bytes(s.bytes_needed):>11} {format_bytes(s.bytes_read):>11} "
                f"{s.requests:>9} {s.files:>5}"
            )
        total = self.bytes_read
        lines.append(
            f"all ranks read {format_bytes(total)} ({total / max(naive, 1):.2f}x the checkpoint; reading every tensor "
            f"whole on every rank would be {self.tp:.0f}x){'; skipped: ' + ', '.join(self.skipped) if self.skipped else ''}"
        )
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
