"""The schedule between plan and executor: pure data saying in which windows each rank fills its shards,
and which ranks share a node. No I/O: built from a plan and tested like one.

A rank's shards are cut into windows of whole destination rows of at most `chunk_bytes`
(one row if a row is larger); each window lists the plan's reads clipped to it. An executor
fills windows independently (in any order, on any thread) into a window-sized buffer
or straight into the shard.

Node reads: a node's ranks read the union of the bytes they need once. `node_schedule`
cuts that union (page-rounded and coalesced, per file) into `Stripe`s of at most `stripe_bytes`; the union
is split into one contiguous, byte-balanced run per rank of the node, so each reader streams sequentially.
`rank_keeps` says which bytes of which stripes a rank copies into its shards. Every `Keep` lies inside
its one stripe: a row of a strided read that crosses a stripe cut is given as a one-row contiguous
`Read` of the same bytes (count 1), split at the cut, so a keeper needs only that stripe to be ready.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ConfigurationError
from .options import DEFAULT_STRIPE_BYTES
from .plans import NodeSchedule, Plan, RankPlan, Read, Stripe, TensorShard

#: The page size stripes are aligned to.
PAGE = 4096
#: Pages of other bytes beside a block read straight into a shard that its reader fetches in the same request (a
#: request of its own would cost more than its bytes).
EDGE_PAGES = 16


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


# --- cooperative reads: one node's stripes and each rank's keeps ---------------------------------------


@dataclass(frozen=True)
class NodeRead:
    """One read by the ranks of a node together (a node backend), the same for each of them: the node's schedule,
    its ranks' plans in `schedule.ranks` order where the backend needs them (an exchange reader sends each rank
    what it keeps; `raylazy.io.nodes.node_read` builds it), an id unique to the read (it names the node's ready
    map, for cooperative stripe readers) and where the ranks meet (the exchange's rendezvous address). `mapped`:
    whether cooperative keepers copy out of mappings of the files (local storage) or read their keeps out of the
    page cache (network storage, where a read failed through a mapping is a SIGBUS). `staged`: storage with no page
    cache to share (object storage, a mount serving direct_io): the cooperative readers fetch the node's bytes into
    shared memory, its stages, and the keepers copy out of those."""

    schedule: NodeSchedule
    plans: tuple[RankPlan, ...] = ()
    load_id: str = ""
    address: str = ""
    mapped: bool = True
    staged: bool = False


class Keep(NamedTuple):
    """Rows (or bytes, for a contiguous read) `part` of a read of rank `rank`'s shard number `tensor` (an index
    into its RankPlan.tensors), all inside stripe `stripe` (an index into the node's stripes)."""

    stripe: int
    rank: int
    tensor: int
    part: Part


def with_node_schedules(plan: Plan, node_ids: Sequence[str], stripe_bytes: int | None = None, max_gap: int = 0,
                        direct: bool = False) -> Plan:
    """A copy of `plan` whose `nodes` hold one NodeSchedule per node, `node_ids[r]` being the node rank r runs on
    (see `node_schedule` for stripe_bytes, max_gap and direct)."""
    return plan.model_copy(update={"nodes": node_schedules(plan, node_ids, stripe_bytes, max_gap, direct)})


def node_rows(plan: Plan) -> list[dict]:
    """One dict per stripe of every node `plan` schedules: who reads it and which ranks keep bytes of it."""
    rows = []
    for n in plan.nodes:
        keepers: dict[int, set[int]] = {}
        for r in n.ranks:
            for k in rank_keeps(plan, n, r):
                keepers.setdefault(k.stripe, set()).add(r)
        for i, s in enumerate(n.stripes):
            rows.append({"node": n.node, "stripe": i, "file": os.path.basename(plan.files[s.file].uri),
                         "start": s.start, "end": s.end, "bytes": s.end - s.start, "reader": s.reader,
                         "keepers": tuple(sorted(keepers.get(i, ())))})
    return rows


def node_schedules(plan: Plan, node_ids: Sequence[str], stripe_bytes: int | None = None,
                   max_gap: int = 0, direct: bool = False) -> tuple[NodeSchedule, ...]:
    """One NodeSchedule per node, `node_ids[r]` being the node rank r runs on (nodes in order of their first rank)."""
    if len(node_ids) != len(plan.ranks):
        raise ValueError(f"{len(node_ids)} node id(s) for {len(plan.ranks)} rank(s)")
    return tuple(node_schedule(plan, ranks, node, stripe_bytes or DEFAULT_STRIPE_BYTES, max_gap=max_gap, direct=direct)
                 for node, ranks in group_by_node(node_ids).nodes.items())


def node_schedule(plan: Plan, ranks: Sequence[int], node: str = "node", stripe_bytes: int = DEFAULT_STRIPE_BYTES,
                  page: int = PAGE, max_gap: int = 0, direct: bool = False) -> NodeSchedule:
    """The stripes node `node` reads for its `ranks`: the page-rounded, coalesced union of the bytes they need
    (each byte once, however many ranks keep it), split into len(ranks) contiguous byte-balanced runs (one per
    reader, in rank order) and cut into stripes of at most `stripe_bytes` (rounded down to whole pages).

    `max_gap` > 0 also reads gaps of at most that many bytes between needed pages, for fewer, larger stripes
    (a node holding half of every row of a row-parallel weight: one stripe run instead of one per row).

    `direct`: the whole pages inside one contiguous read of a rank that no other rank of the node needs (a
    column-parallel weight's block) are stripes of their own, read by that rank straight into its shard
    (`NodeSchedule.direct`); a short run of other pages beside such a block (the partial pages at its edges, a
    norm between two blocks: at most `EDGE_PAGES`) is read by the same rank in the same request (`request_runs`),
    the block's cuts shifted to leave it room; only the rest of the union is balanced between the readers."""
    if stripe_bytes < page:
        raise ConfigurationError(f"stripe_bytes must be at least one page ({page}), got {stripe_bytes}")
    stripe_bytes -= stripe_bytes % page
    ranks = tuple(ranks)
    union = node_union(plan, ranks, page, max_gap)
    owned = _owned(plan, ranks, page) if direct and len(ranks) > 1 else {}
    shared = {f: minus(spans, owned.get(f, [])) for f, spans in union.items()}
    taken, extent = _beside(owned, shared, EDGE_PAGES * page)
    shared = {f: minus(spans, taken.get(f, [])) for f, spans in shared.items()}
    total = sum(e - s for spans in shared.values() for s, e in spans)
    stripes, direct_stripes = [], set()
    for f, spans in owned.items():
        for start, end, reader in spans:
            lo, hi = extent.get((f, start, end), (start, end))
            cuts = sorted({*range(lo, hi, stripe_bytes), start, end, hi})
            for a, b in zip(cuts, cuts[1:]):
                stripes.append(Stripe(f, a, b, reader))
                if start <= a < end:
                    direct_stripes.add(stripes[-1])
    k, done = 0, 0  # the current reader (index into ranks) and the shared bytes before the current span
    for f in sorted(shared):
        for start, end in shared[f]:
            pos = start
            while pos < end:
                # the reader's run ends at the next balanced cut, rounded down to a page (not before pos)
                cut = end
                if k < len(ranks) - 1:
                    target = start + (total * (k + 1) // len(ranks) - done)
                    if target < end:
                        cut = max(pos, target - target % page)
                if cut == pos:
                    k += 1
                    continue
                for a in range(pos, cut, stripe_bytes):
                    stripes.append(Stripe(f, a, min(a + stripe_bytes, cut), ranks[k]))
                pos = cut
            done += end - start
    stripes.sort(key=lambda s: (s.file, s.start))
    return NodeSchedule.model_construct(node=node, ranks=ranks, stripe_bytes=stripe_bytes, stripes=tuple(stripes),
                                        direct=tuple(i for i, s in enumerate(stripes) if s in direct_stripes))


def _beside(owned: dict[int, list[tuple[int, int, int]]], shared: dict[int, list[tuple[int, int]]],
            most: int) -> tuple[dict[int, list[tuple[int, int]]], dict[tuple[int, int, int], tuple[int, int]]]:
    """The shared spans of at most `most` bytes that touch an owned span, each read with one (the owned span it
    follows, else the one it precedes): (file -> those spans, sorted; (file, start, end) of an owned span -> its
    extent with the spans read with it)."""
    taken: dict[int, list[tuple[int, int]]] = {}
    extent: dict[tuple[int, int, int], tuple[int, int]] = {}
    for f, spans in owned.items():
        ends, starts = {b: (a, b) for a, b, _ in spans}, {a: (a, b) for a, b, _ in spans}
        for a, b in shared.get(f, []):
            span = ends.get(a) or starts.get(b)
            if b - a <= most and span:
                lo, hi = extent.get((f, *span), span)
                extent[(f, *span)] = (min(lo, a), max(hi, b))
                taken.setdefault(f, []).append((a, b))
    return taken, extent


def request_runs(sched: NodeSchedule, rank: int) -> list[tuple[int, ...]]:
    """The stripes `rank` reads (`NodeSchedule.read_by`) as one request each where it reads them into buffers
    (staged): runs of adjacent stripes (one ending where the next begins) of at most `stripe_bytes` together."""
    runs: list[list[int]] = []
    for i in sched.read_by(rank):
        s = sched.stripes[i]
        if runs:
            first, last = sched.stripes[runs[-1][0]], sched.stripes[runs[-1][-1]]
            if (last.file, last.end) == (s.file, s.start) and s.end - first.start <= sched.stripe_bytes:
                runs[-1].append(i)
                continue
        runs.append([i])
    return [tuple(r) for r in runs]


def run_span(sched: NodeSchedule, run: tuple[int, ...]) -> Stripe:
    """The bytes one request of `request_runs` reads: from its first stripe's start to its last one's end."""
    return sched.stripes[run[0]]._replace(end=sched.stripes[run[-1]].end)


def _owned(plan: Plan, ranks: tuple[int, ...], page: int) -> dict[int, list[tuple[int, int, int]]]:
    """file -> sorted, disjoint (start, end, rank): the whole pages inside one contiguous read of `rank` that no
    other of `ranks` needs a byte of (a span never crosses from one read into another)."""
    alone = {r: node_union(plan, [r], page) for r in ranks}
    owned: dict[int, list[tuple[int, int, int]]] = {}
    for r in ranks:
        inner: dict[int, list[tuple[int, int]]] = {}
        for t in plan.ranks[r].tensors:
            for rd in t.reads:
                a, b = -(-rd.offset // page) * page, (rd.offset + rd.length) // page * page
                if rd.count == 1 and a < b:
                    inner.setdefault(rd.file, []).append((a, b))
        for f, spans in inner.items():
            others = coalesce([x for q in ranks if q != r for x in alone[q].get(f, [])], 0)
            disjoint, end = [], 0  # a rank's reads of the same bytes twice: each byte in one span
            for a, b in sorted(spans):
                if b > max(a, end):
                    disjoint.append((max(a, end), b))
                    end = b
            owned.setdefault(f, []).extend((a, b, r) for a, b in minus(disjoint, others))
    return {f: sorted(spans) for f, spans in owned.items()}


def minus(spans: list[tuple[int, int]], cut) -> list[tuple[int, int]]:
    """Sorted, disjoint `spans` less sorted, disjoint `cut` (whose items may carry more fields after start, end)."""
    out, j = [], 0
    for a, b in spans:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > a:
                out.append((a, cut[k][0]))
            a = max(a, cut[k][1])
            k += 1
        if a < b:
            out.append((a, b))
    return out


def node_union(plan: Plan, ranks: Sequence[int], page: int = PAGE, max_gap: int = 0) -> dict[int, list[tuple[int, int]]]:
    """file -> sorted, disjoint [start, end) spans: the pages holding any byte `ranks` need (ends clipped to
    the file's size), coalesced where at most `max_gap` bytes apart.

    Strided reads of one tensor's rows from several ranks (same file, row start, stride and count) are
    merged into one row pattern first; when no gap of the pattern can hold a whole page, its pages are
    one span, so a row-parallel weight shared by all a node's ranks costs one span, not one per row."""
    spans: dict[int, list[tuple[int, int]]] = {}
    combs: dict[tuple[int, int, int, int], list[tuple[int, int]]] = {}
    for rank in ranks:
        for t in plan.ranks[rank].tensors:
            for r in t.reads:
                if r.count == 1 or r.length == r.stride:
                    spans.setdefault(r.file, []).append((r.offset, r.offset + r.span))
                    continue
                x = (r.offset - t.offset) % r.stride
                if x + r.length > r.stride:  # rows not within the tensor's rows: a pattern of its own
                    x = 0
                combs.setdefault((r.file, r.offset - x, r.stride, r.count), []).append((x, r.length))
    for (f, base, stride, count), pieces in combs.items():
        pattern = coalesce([(x, x + n) for x, n in pieces], 0)
        gaps = [b[0] - a[1] for a, b in zip(pattern, pattern[1:])] + [stride - pattern[-1][1] + pattern[0][0]]
        if max(gaps) < max(page, max_gap + 1):  # every page from the first needed byte to the last is read
            spans.setdefault(f, []).append((base + pattern[0][0], base + (count - 1) * stride + pattern[-1][1]))
        else:
            spans.setdefault(f, []).extend(_rows(base, stride, count, pattern, page))
    return {f: coalesce([(a - a % page, min(-(-b // page) * page, plan.files[f].size)) for a, b in s], max_gap)
            for f, s in spans.items()}


def _rows(base: int, stride: int, count: int, pattern: list[tuple[int, int]], page: int) -> list[tuple[int, int]]:
    """The page-rounded spans of `count` rows of `pattern`, merged where they touch (numpy: rows can be many)."""
    import numpy as np

    rows = base + np.arange(count, dtype=np.int64)[:, None] * stride
    starts = (rows + np.array([a for a, _ in pattern], dtype=np.int64)).ravel()
    ends = (rows + np.array([b for _, b in pattern], dtype=np.int64)).ravel()
    starts -= starts % page
    ends = -(-ends // page) * page
    new = np.flatnonzero(starts[1:] > ends[:-1]) + 1
    return list(zip(starts[np.r_[0, new]].tolist(), ends[np.r_[new - 1, len(ends) - 1]].tolist()))


def coalesce(spans: list[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """Sorted spans merged where they overlap or are at most `gap` bytes apart."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def rank_keeps(plan: Plan | RankPlan, sched: NodeSchedule, rank: int | None = None) -> tuple[Keep, ...]:
    """What `rank` copies out of its node's stripes into its shards, in stripe order: every byte its shards need,
    exactly once. `plan` is the Plan (then `rank` picks the rank) or the rank's own RankPlan."""
    rp = plan if isinstance(plan, RankPlan) else plan.ranks[rank]
    by_file: dict[int, tuple[list[int], list[int]]] = {}  # file -> (stripe starts, stripe indices)
    for i, s in enumerate(sched.stripes):
        starts, index = by_file.setdefault(s.file, ([], []))
        starts.append(s.start)
        index.append(i)
    stripes = sched.stripes
    keeps: list[Keep] = []

    def contiguous(ti: int, r: Read, lo: int, hi: int) -> None:
        """Keep bytes [lo, hi) of contiguous read `r` (relative to its offset), split at stripe cuts."""
        starts, index = by_file[r.file]
        j = bisect_right(starts, r.offset + lo) - 1
        while lo < hi:
            s = stripes[index[j]]
            end = min(hi, s.end - r.offset)
            keeps.append(Keep(index[j], rp.rank, ti, Part(r, lo, end - lo)))
            lo, j = end, j + 1

    for ti, t in enumerate(rp.tensors):
        for r in t.reads:
            if r.count == 1:
                contiguous(ti, r, 0, r.length)
                continue
            starts, index = by_file[r.file]
            o, step, n = r.offset, r.stride, r.length
            j = bisect_right(starts, o) - 1
            while j < len(starts) and starts[j] < o + r.span:
                s = stripes[index[j]]
                first = max(0, -(-(s.start - o) // step))  # rows starting in this stripe ...
                last = min(r.count, (s.end - 1 - o) // step + 1)
                whole = min(last, (s.end - n - o) // step + 1)  # ... of which these end in it too
                if whole > first:
                    keeps.append(Keep(index[j], rp.rank, ti, Part(r, first, whole - first)))
                if last > max(first, whole):  # the last row crosses the stripe's end: bytes, cut at the stripes
                    row = last - 1
                    one = Read(file=r.file, offset=o + row * step, length=n, dst_offset=r.dst_offset + row * r.dst_stride)
                    contiguous(ti, one, 0, n)
                j += 1
    keeps.sort(key=lambda k: k.stripe)
    return tuple(keeps)
