"""The schedule between plan and executor: pure data saying in which windows each rank fills its shards,
and which ranks share a node. No I/O: built from a plan and tested like one.

A rank's shards are cut into windows of whole destination rows of at most `chunk_bytes`
(one row if a row is larger); each window lists the plan's reads clipped to it. An executor
fills windows independently (in any order, on any thread) into a window-sized buffer
or straight into the shard. Cooperative reads (issue 17: per-node stripes, who reads which,
what each rank sends and receives) extend `RankSchedule` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

from .plans import RankPlan, Read, TensorShard


class Part(NamedTuple):
    """A read clipped to a window: rows [first, first + n) of a strided read (`count` > 1), or bytes
    [first, first + n) of a contiguous one."""

    read: Read
    first: int
    n: int

    @property
    def bytes_needed(self) -> int:
        return self.read.length * self.n if self.read.count > 1 else self.n


@dataclass(frozen=True)
class Window:
    """Bytes [start, end) of shard `tensor` (an index into the rank plan's tensors), filled by `parts`.
    `padded`: the shard has bytes no read covers (zeros), so a reused buffer must be zeroed first."""

    tensor: int
    start: int
    end: int
    parts: tuple[Part, ...]
    padded: bool

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def bytes_needed(self) -> int:
        return sum(p.bytes_needed for p in self.parts)


@dataclass(frozen=True)
class RankSchedule:
    """One rank's windows, shard by shard in plan order, each shard's windows in byte order."""

    rank: int
    chunk_bytes: int
    windows: tuple[Window, ...]

    @property
    def window_bytes(self) -> int:
        """The largest window: the size of a staging buffer that fits any window."""
        return max((w.nbytes for w in self.windows), default=0)

    @property
    def bytes_needed(self) -> int:
        return sum(w.bytes_needed for w in self.windows)


def rank_schedule(plan: RankPlan, chunk_bytes: int) -> RankSchedule:
    """Cut every shard of `plan` into windows of whole rows, at most `chunk_bytes` unless one row is larger."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    windows = tuple(w for i, t in enumerate(plan.tensors) for w in shard_windows(i, t, chunk_bytes))
    return RankSchedule(rank=plan.rank, chunk_bytes=chunk_bytes, windows=windows)


def shard_windows(index: int, t: TensorShard, chunk: int) -> Iterator[Window]:
    """The windows of shard `t` (number `index` in its rank plan)."""
    rows = {r.dst_stride for r in t.reads if r.count > 1}
    row = rows.pop() if rows else 1
    width = max(row, chunk // row * row)
    padded = t.bytes_needed < t.nbytes
    for start in range(0, t.nbytes, width):
        end = min(start + width, t.nbytes)
        parts = []
        for r in t.reads:
            if r.count > 1:  # rows i with dst_offset + i*dst_stride in [start, end)
                first = max(0, -(-(start - r.dst_offset) // r.dst_stride))
                last = min(r.count, -(-(end - r.dst_offset) // r.dst_stride))
                if last > first:
                    parts.append(Part(r, first, last - first))
            else:  # a contiguous range clipped to the window
                lo, hi = max(start, r.dst_offset), min(end, r.dst_offset + r.length)
                if hi > lo:
                    parts.append(Part(r, lo - r.dst_offset, hi - lo))
        yield Window(index, start, end, tuple(parts), padded)


@dataclass(frozen=True)
class NodeGroups:
    """Which ranks share each node. `nodes` maps a node id to its ranks in rank order (nodes in order
    of their first rank); `local_rank[r]` is rank r's position among its node's ranks."""

    node_of: tuple[str, ...]
    nodes: dict[str, tuple[int, ...]]
    local_rank: tuple[int, ...]

    def peers(self, rank: int) -> tuple[int, ...]:
        """The ranks on `rank`'s node, itself included."""
        return self.nodes[self.node_of[rank]]


def group_by_node(node_ids: Sequence[str]) -> NodeGroups:
    """Group ranks by node: `node_ids[r]` is the node rank r runs on."""
    nodes: dict[str, list[int]] = {}
    local = []
    for rank, node in enumerate(node_ids):
        ranks = nodes.setdefault(node, [])
        local.append(len(ranks))
        ranks.append(rank)
    return NodeGroups(tuple(node_ids), {n: tuple(r) for n, r in nodes.items()}, tuple(local))
