"""The load plan: immutable, picklable data saying which bytes each rank reads and where they go.

A `Read` is a run of `count` equal-sized byte ranges in one file, `stride` bytes
apart, that land `dst_stride` bytes apart in the shard's buffer: one range for a
dim-0 slice, one range per row for a slice of the last dim. With `gather`, the
reader fetches the whole span (gaps included) in one request and keeps the rows.
"""

from __future__ import annotations

import os
from functools import partial
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import core_schema

from ..errors import LayoutMismatchError, PlanFormatError
from .dtypes import DTYPE_BITS
from .kinds import StorageKind
from .mesh import Mesh


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileRef(_Frozen):
    """A checkpoint file as planned: URI (a plain path for a local file), size, header digest and the storage's
    version tag (an object's ETag; "" for local files), all checked again before reading."""

    uri: str
    size: int
    digest: str
    version: str = ""

    @classmethod
    def of(cls, header) -> FileRef:
        """The plan's reference to a file whose header was read (a `raylazy.core.header.FileHeader`)."""
        return cls(uri=header.path, size=header.file_size, digest=header.digest, version=header.version)


def _record_schema(source: type, handler, dump) -> core_schema.CoreSchema:
    """How pydantic holds the plan's per-tensor records (`Read`, `TensorShard`), named tuples: the planner builds
    ~10^5 of them for a large checkpoint, and a validated model took most of planning's time. An instance is taken
    as it is; JSON is read into one as a model's fields are (checked, extra keys refused) and written as an object
    of its fields (`dump`)."""
    native = handler(source)
    return core_schema.json_or_python_schema(
        json_schema=native, python_schema=core_schema.union_schema([core_schema.is_instance_schema(source), native]),
        serialization=core_schema.plain_serializer_function_ser_schema(dump))


class Read(NamedTuple):
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

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return _record_schema(source, handler, Read._asdict)


class TensorShard(NamedTuple):
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
    dim: int | None
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

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return _record_schema(source, handler, lambda t: {**t._asdict(), "reads": [r._asdict() for r in t.reads]})


#: A Read and a TensorShard from the tuple of all their fields, made in C: a large plan makes ~10^5 of each, and
#: a NamedTuple's own constructor is Python.
read_of = partial(tuple.__new__, Read)
shard_of = partial(tuple.__new__, TensorShard)


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


class Stripe(NamedTuple):
    """Bytes [start, end) of plan file `file`, read once on its node by global rank `reader` (the exchange, and
    cooperative stripe readers; without stripe readers the page cache reads it and `reader` is the rank whose
    share of the node's union it counts in)."""

    file: int
    start: int
    end: int
    reader: int


class NodeSchedule(_Frozen):
    """One node's cooperative reads (`raylazy.core.schedule.node_schedule`): the page-rounded, coalesced union of
    the bytes its ranks need, cut into `stripes` of at most `stripe_bytes`, each read once by one of its
    `ranks` (global ranks; the local rank is the index). Stripes are sorted by (file, start) and disjoint;
    each reader's stripes are one contiguous run of the union, so it reads sequentially, but for `direct`: the
    indices of stripes only their reader keeps bytes of, inside one contiguous read of its shards, which it reads
    straight into the shard (staged cooperative reads; `node_schedule(direct=True)`), and the short runs of
    stripes beside them that their reader fetches in the same requests (`request_runs`)."""

    node: str
    ranks: tuple[int, ...]
    stripe_bytes: int
    stripes: tuple[Stripe, ...]
    direct: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes the node reads from storage (the page-rounded union)."""
        return sum(s.end - s.start for s in self.stripes)

    @property
    def staged_bytes(self) -> int:
        """Bytes the node stages, staged: all it reads but its direct stripes'."""
        return self.nbytes - sum(self.stripes[i].end - self.stripes[i].start for i in self.direct)

    def read_by(self, rank: int) -> tuple[int, ...]:
        """Indices of the stripes `rank` reads, in order."""
        return tuple(i for i, s in enumerate(self.stripes) if s.reader == rank)


class Plan(_Frozen):
    """The whole load: one RankPlan per rank, plus what was planned from and skipped; `nodes`, when
    scheduled (`raylazy.core.schedule.with_node_schedules`), holds each node's cooperative reads."""

    root: str
    model_type: str | None
    mesh: Mesh
    #: Row gaps of at most this many bytes were read through; None: each read chose by the storage's cost model.
    max_gap: int | None
    uneven: str
    checkpoint_bytes: int
    files: tuple[FileRef, ...]
    skipped: tuple[str, ...]
    ranks: tuple[RankPlan, ...]
    nodes: tuple[NodeSchedule, ...] = ()
    #: The storage the checkpoint is on (`raylazy.storage.kinds`); None where its storage cannot tell.
    storage: StorageKind | None = None

    @property
    def tp(self) -> int:
        return self.mesh.tp

    def node_of(self, rank: int) -> NodeSchedule:
        """The schedule of the node holding `rank` (KeyError if the plan has none for it)."""
        for n in self.nodes:
            if rank in n.ranks:
                return n
        raise KeyError(f"rank {rank} is on no scheduled node: schedule the plan first "
                       "(raylazy.core.schedule.with_node_schedules)")

    @property
    def bytes_needed(self) -> int:
        return sum(r.stats.bytes_needed for r in self.ranks)

    @property
    def bytes_read(self) -> int:
        return sum(r.stats.bytes_read for r in self.ranks)

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
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
            f"{f'pp={self.mesh.pp}, ' if self.mesh.pp > 1 else ''}"
            f"{len(self.files)} file(s), {format_bytes(naive)} in the checkpoint",
            *([f"storage: {self.storage.describe()}"] if self.storage else []),
            f"{'rank':>4} {'tensors':>8} {'needed':>11} {'read':>11} {'requests':>9} {'files':>5}",
        ]
        reading = self.ranks[: len(self.ranks) // self.mesh.dp]  # replica 0 reads; the other replicas copy it
        for rp in reading:
            s = rp.stats
            lines.append(
                f"{rp.rank:>4} {s.tensors:>8} {format_bytes(s.bytes_needed):>11} {format_bytes(s.bytes_read):>11} "
                f"{s.requests:>9} {s.files:>5}"
            )
        total = sum(rp.stats.bytes_read for rp in reading)
        lines.append(
            f"all ranks read {format_bytes(total)} ({total / max(naive, 1):.2f}x the checkpoint; reading every tensor "
            f"whole on every rank would be {len(reading)}x){_skipped(self.skipped)}"
        )
        if self.mesh.dp > 1:
            lines.append(f"replicas 1-{self.mesh.dp - 1} ({len(self.ranks) - len(reading)} rank(s)) copy the same shards "
                         "from replica 0's ranks, reading nothing from storage")
        for n in self.nodes:
            needed = sum(self.ranks[r].stats.bytes_needed for r in n.ranks)
            lines.append(
                f"node {n.node}: ranks {','.join(map(str, n.ranks))} read {format_bytes(n.nbytes)} once "
                f"({n.nbytes / max(needed, 1):.2f}x their needed bytes) in {len(n.stripes)} stripe(s) of at most "
                f"{format_bytes(n.stripe_bytes)}"
            )
        return "\n".join(lines)


def _skipped(names: tuple[str, ...], shown: int = 10) -> str:
    """The summary's note of the tensors not loaded: the first `shown` names, and how many more (DeepSeek-V3 skips
    its 1,564-tensor multi-token-prediction layer)."""
    if not names:
        return ""
    more = f" and {len(names) - shown:,} more" if len(names) > shown else ""
    return f"; skipped: {', '.join(names[:shown])}{more}"


def format_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def check_same_layout(loaded: Plan, new: Plan) -> None:
    """LayoutMismatchError unless every rank of `new` has the tensors of `loaded`'s rank, each with the same
    shard shape and dtype (what reading into the loaded shards needs); names the first difference."""
    if len(new.ranks) != len(loaded.ranks):
        raise LayoutMismatchError(f"{new.root}: planned for {len(new.ranks)} ranks, the loaded model has "
                                  f"{len(loaded.ranks)}: reload needs the same ranks; raylazy.load it instead")
    for old_rank, new_rank in zip(loaded.ranks, new.ranks):
        old = {t.name: f"{t.dtype} {list(t.shape)}" for t in old_rank.tensors}
        got = {t.name: f"{t.dtype} {list(t.shape)}" for t in new_rank.tensors}
        name = next((n for n in sorted(old.keys() | got.keys()) if old.get(n) != got.get(n)), None)
        if name is not None:
            raise LayoutMismatchError(
                f"{new.root}: rank {new_rank.rank}'s tensor {name!r} is {got.get(name, 'absent')} in the new "
                f"checkpoint but {old.get(name, 'absent')} in the loaded one (a reload needs the same tensor names, "
                "shapes and dtypes on every rank): raylazy.load it instead")
