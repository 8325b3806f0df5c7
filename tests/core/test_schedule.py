"""The schedule (raylazy.core.schedule) without I/O: windows tile each shard, their parts cover every needed
byte exactly once and reproduce the plan's reads, sizes respect chunk_bytes, padding is flagged; and
the per-node grouping of ranks."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from raylazy.core.checkpoint import Checkpoint, ModelConfig
from raylazy.core.header import parse_header
from raylazy.core.placements import Fused, Replicated, Split
from raylazy.core.plans import Plan
from raylazy.core.schedule import (
    EDGE_PAGES,
    RankSchedule,
    group_by_node,
    node_rows,
    node_schedule,
    node_schedules,
    rank_keeps,
    rank_schedule,
    request_runs,
    with_node_schedules,
)
from raylazy.errors import ConfigurationError
from raylazy.planning import make_plan
from tests.support.planlib import apply_reads, read_files, read_ranges


def _checkpoint(specs: dict) -> tuple[Checkpoint, bytes]:
    """An in-memory checkpoint of one file holding {name: (dtype, shape, itemsize)} with patterned bytes."""
    header, data = {}, b""
    for name, (dtype, shape, size) in specs.items():
        n = size
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + n]}
        data += bytes((len(data) + i * 31 + 7) % 251 for i in range(n))
    text = json.dumps(header).encode()
    blob = struct.pack("<Q", len(text)) + text + data
    ckpt = Checkpoint(root="/nonexistent", files=(parse_header(blob, len(blob), "mem.safetensors"),), config=ModelConfig())
    return ckpt, blob


def _run_windows(schedule: RankSchedule, rank_plan, files) -> list[bytearray]:
    """Execute the schedule as the Part docstring says, counting how often each shard byte is written."""
    out = [bytearray(t.nbytes) for t in rank_plan.tensors]
    hits = [[0] * t.nbytes for t in rank_plan.tensors]
    for w in schedule.windows:
        for p in w.parts:
            r, data = p.read, files[p.read.file]
            if r.count > 1:
                ranges = [(r.offset + i * r.stride, r.dst_offset + i * r.dst_stride, r.length)
                          for i in range(p.first, p.first + p.n)]
            else:
                ranges = [(r.offset + p.first, r.dst_offset + p.first, p.n)]
            for src, dst, length in ranges:
                assert w.start <= dst and dst + length <= w.end, "a part lands outside its window"
                out[w.tensor][dst : dst + length] = data[src : src + length]
                for b in range(dst, dst + length):
                    hits[w.tensor][b] += 1
    for t, h in zip(rank_plan.tensors, hits):
        needed = sum(h)
        assert max(h, default=0) <= 1, f"{t.name}: a byte is written twice"
        assert needed == t.bytes_needed, f"{t.name}: {needed} bytes written, {t.bytes_needed} needed"
    return out


def _check(plan, blob: bytes, chunk: int) -> list[RankSchedule]:
    schedules = []
    for rp in plan.ranks:
        s = rank_schedule(rp, chunk)
        schedules.append(s)
        assert s.rank == rp.rank and s.chunk_bytes == chunk
        assert s.bytes_needed == rp.stats.bytes_needed
        # windows tile each shard in order: contiguous, no gap, no overlap
        for i, t in enumerate(rp.tensors):
            ws = [w for w in s.windows if w.tensor == i]
            assert [w.start for w in ws] == ([0] + [w.end for w in ws[:-1]] if ws else [])
            assert (ws[-1].end if ws else 0) == t.nbytes
            assert all(w.padded == (t.bytes_needed < t.nbytes) for w in ws)
            rows = {r.dst_stride for r in t.reads if r.count > 1}
            for w in ws:
                if rows:  # whole destination rows; at most one chunk unless a row is larger
                    (row,) = rows
                    assert w.start % row == 0 and (w.end % row == 0 or w.end == t.nbytes)
                    assert w.nbytes <= max(chunk, row)
                else:
                    assert w.nbytes <= chunk
        assert s.window_bytes == max((w.nbytes for w in s.windows), default=0)
        got = _run_windows(s, rp, [blob])
        assert [bytes(g) for g in got] == [apply_reads(t, [blob]) for t in rp.tensors]
    return schedules


SPECS = {
    "col": ("BF16", (12, 20), 2),   # Split(0): one contiguous range per rank
    "row": ("F32", (6, 24), 4),     # Split(-1): one range per row
    "vec": ("U8", (10,), 1),
    "rep": ("F16", (3, 5), 2),
    "fused": ("F16", (5, 36), 2),   # two parts along the last dim: two reads per row, the second at a row offset
}
RULES = [("col", Split(0)), ("row", Split(-1)), ("vec", Split(0)), ("rep", Replicated()),
         ("fused", Fused((Split(-1), Split(-1)), dim=-1))]


@pytest.mark.parametrize("chunk", (1, 7, 16, 40, 96, 1 << 20))
@pytest.mark.parametrize("tp", (1, 2, 3))
def test_windows_cover_needed_bytes_once_and_reproduce_the_reads(chunk, tp):
    ckpt, blob = _checkpoint(SPECS)
    plan = make_plan(ckpt, tp, rules=RULES, preset=None, uneven="pad")
    _check(plan, blob, chunk)


def test_row_larger_than_the_chunk_is_one_window_per_row():
    ckpt, blob = _checkpoint({"row": ("F32", (5, 32), 4)})
    rp = make_plan(ckpt, 2, rules=[("row", Split(-1))], preset=None).ranks[1]
    (t,) = rp.tensors
    row = t.reads[0].dst_stride
    assert row == 64
    (s,) = _check(make_plan(ckpt, 2, rules=[("row", Split(-1))], preset=None), blob, 10)[1:]
    assert [(w.start, w.end) for w in s.windows] == [(i * row, (i + 1) * row) for i in range(5)]
    assert all(len(w.parts) == 1 and w.parts[0].n == 1 for w in s.windows)
    # a chunk of 2.5 rows holds 2 whole rows
    s = rank_schedule(rp, 160)
    assert [(w.start, w.end) for w in s.windows] == [(0, 128), (128, 256), (256, 320)]


def test_contiguous_range_is_clipped_to_windows():
    ckpt, blob = _checkpoint({"col": ("BF16", (8, 10), 2)})
    plan = make_plan(ckpt, 2, rules=[("col", Split(0))], preset=None)
    rp = plan.ranks[1]
    (read,) = rp.tensors[0].reads
    s = _check(plan, blob, 30)[1]
    assert [(w.start, w.end) for w in s.windows] == [(0, 30), (30, 60), (60, 80)]
    assert [(p.read, p.first, p.n) for w in s.windows for p in w.parts] == [(read, 0, 30), (read, 30, 30), (read, 60, 20)]


def test_padding_is_flagged_and_left_unwritten():
    ckpt, blob = _checkpoint({"vocab": ("BF16", (10, 4), 2)})
    plan = make_plan(ckpt, 4, rules=[("vocab", Split(0))], preset=None, uneven="pad")  # 3 rows each, 2 past the end
    schedules = _check(plan, blob, 8)
    last = schedules[-1]
    assert all(w.padded for w in last.windows) and last.bytes_needed == 1 * 4 * 2
    assert not any(w.padded for w in schedules[0].windows)
    padded_window = last.windows[-1]
    assert padded_window.parts == () and padded_window.bytes_needed == 0  # only padding: nothing to read


def test_gather_reads_are_split_by_rows_too():
    ckpt, blob = _checkpoint({"row": ("F32", (6, 24), 4)})
    plan = make_plan(ckpt, 3, rules=[("row", Split(-1))], preset=None, max_gap=1 << 20)
    assert all(r.gather for rp in plan.ranks for r in rp.tensors[0].reads)
    _check(plan, blob, 70)


def test_empty_plan_has_no_windows():
    ckpt, blob = _checkpoint({"empty": ("BF16", (0, 4), 2)})
    (s,) = _check(make_plan(ckpt, 1, rules=[("empty", Split(0))], preset=None), blob, 16)
    assert s.windows == () and s.window_bytes == 0


def test_chunk_must_be_positive():
    ckpt, _ = _checkpoint({"a": ("U8", (4,), 1)})
    with pytest.raises(ValueError, match="chunk_bytes"):
        rank_schedule(make_plan(ckpt, 1, rules=[("a", Replicated())], preset=None).ranks[0], 0)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 9), cols=st.integers(1, 9), size=st.sampled_from((1, 2, 4)), tp=st.integers(1, 4),
    dim=st.integers(0, 1), chunk=st.integers(1, 200), gap=st.sampled_from((0, 8, 1 << 20)),
)
@example(rows=1, cols=9, size=4, tp=4, dim=1, chunk=1, gap=0)
def test_property_windows(rows, cols, size, tp, dim, chunk, gap):
    ckpt, blob = _checkpoint({"t": ("U8" if size == 1 else "F16" if size == 2 else "F32", (rows, cols), size)})
    plan = make_plan(ckpt, tp, rules=[("t", Split(dim))], preset=None, uneven="pad", max_gap=gap)
    _check(plan, blob, chunk)


# --- ranks per node -----------------------------------------------------------------------------


def test_group_by_node():
    g = group_by_node(["b", "a", "b", "c", "a", "b"])
    assert g.nodes == {"b": (0, 2, 5), "a": (1, 4), "c": (3,)}
    assert list(g.nodes) == ["b", "a", "c"]  # nodes in order of their first rank
    assert g.local_rank == (0, 0, 1, 0, 1, 2)
    assert g.peers(4) == (1, 4) and g.peers(3) == (3,)
    assert g.node_of == ("b", "a", "b", "c", "a", "b")


def test_group_by_node_one_node_and_empty():
    g = group_by_node(["n"] * 4)
    assert g.nodes == {"n": (0, 1, 2, 3)} and g.local_rank == (0, 1, 2, 3)
    e = group_by_node([])
    assert e.nodes == {} and e.local_rank == () and e.node_of == ()


# --- cooperative reads: node stripes and keeps ------------------------------------------------------


def _needed_pages(plan, ranks, page: int) -> dict[int, set[int]]:
    """file -> the pages holding any byte `ranks` need, by brute force over every range of every read."""
    pages: dict[int, set[int]] = {}
    for rank in ranks:
        for t in plan.ranks[rank].tensors:
            for r in t.reads:
                for src, _, length in read_ranges(r):
                    pages.setdefault(r.file, set()).update(range(src // page, (src + length - 1) // page + 1))
    return pages


def _check_node(plan, sched, files: list[bytes], page: int) -> None:
    """Stripes: sorted, disjoint, aligned, at most stripe_bytes, exactly the page-rounded union, one contiguous
    byte-balanced run per reader. Keeps: inside their stripe, and executed against the file bytes they fill
    each rank's shards exactly as its reads do, each needed byte once."""
    stripes = sched.stripes
    assert list(stripes) == sorted(stripes, key=lambda s: (s.file, s.start))
    for a, b in zip(stripes, stripes[1:]):
        assert (a.file, a.end) <= (b.file, b.start), "stripes overlap"
    got_pages: dict[int, set[int]] = {}
    for s in stripes:
        size = plan.files[s.file].size
        assert s.start % page == 0 and (s.end % page == 0 or s.end == size) and s.start < s.end <= size
        assert s.end - s.start <= sched.stripe_bytes and s.reader in sched.ranks
        got_pages.setdefault(s.file, set()).update(range(s.start // page, -(-s.end // page)))
    assert got_pages == _needed_pages(plan, sched.ranks, page)
    assert sched.nbytes == sum(min((p + 1) * page, plan.files[f].size) - p * page
                               for f, ps in got_pages.items() for p in ps)
    _check_direct(plan, sched, page)
    edges = _check_edges(plan, sched, page)
    _check_requests(sched)
    shared = [s for i, s in enumerate(stripes) if i not in sched.direct and i not in edges]
    readers = [s.reader for s in shared]  # each reader's stripes are one run, readers in rank order
    runs = [r for i, r in enumerate(readers) if i == 0 or readers[i - 1] != r]
    assert runs == sorted(set(runs), key=sched.ranks.index)
    share = [sum(s.end - s.start for s in shared if s.reader == r) for r in sched.ranks]
    assert max(share) - min(share) <= 2 * page + sched.nbytes % len(sched.ranks), share
    for rank in sched.ranks:
        rp = plan.ranks[rank]
        out = [bytearray(t.nbytes) for t in rp.tensors]
        hits = [bytearray(t.nbytes) for t in rp.tensors]
        keeps = rank_keeps(plan, sched, rank)
        assert keeps == rank_keeps(rp, sched)
        assert [k.stripe for k in keeps] == sorted(k.stripe for k in keeps)
        for k in keeps:
            assert k.rank == rank
            r, s = k.part.read, stripes[k.stripe]
            rows = range(k.part.first, k.part.first + k.part.n) if r.count > 1 else (0,)
            for i in rows:
                src = r.offset + i * r.stride + (k.part.first if r.count == 1 else 0)
                dst = r.dst_offset + i * r.dst_stride + (k.part.first if r.count == 1 else 0)
                n = k.part.n if r.count == 1 else r.length
                assert r.file == s.file and s.start <= src and src + n <= s.end, "a keep reaches outside its stripe"
                out[k.tensor][dst : dst + n] = files[r.file][src : src + n]
                for b in range(dst, dst + n):
                    hits[k.tensor][b] += 1
        for t, o, h in zip(rp.tensors, out, hits):
            assert max(h, default=0) <= 1, f"rank {rank}: {t.name}: a byte is kept twice"
            assert sum(h) == t.bytes_needed, f"rank {rank}: {t.name}: {sum(h)} bytes kept, {t.bytes_needed} needed"
            assert bytes(o) == apply_reads(t, files), f"rank {rank}: {t.name}"


def _check_direct(plan, sched, page: int) -> None:
    """Direct stripes are exactly the pages that lie whole inside one contiguous read of one rank and hold no byte
    another rank of the node needs (by brute force), each read by that rank."""
    if not sched.direct:
        return
    theirs = {r: _needed_pages(plan, [r], page) for r in sched.ranks}
    want = set()
    for r in sched.ranks:
        for t in plan.ranks[r].tensors:
            for x in t.reads:
                if x.count == 1:
                    want.update((x.file, p, r) for p in range(-(-x.offset // page), (x.offset + x.length) // page)
                                if not any(p in theirs[q].get(x.file, ()) for q in sched.ranks if q != r))
    got = {(s.file, p, s.reader) for s in (sched.stripes[i] for i in sched.direct)
           for p in range(s.start // page, s.end // page)}
    assert got == want
    assert sched.staged_bytes == sched.nbytes - len(got) * page


def _check_edges(plan, sched, page: int) -> set[int]:
    """Each run of at most EDGE_PAGES consecutive needed pages outside the direct stripes that touches one (by brute
    force over the pages) is read by that direct stripe's reader, the one before it where both; returns the indices
    of the stripes holding them."""
    owner = {(s.file, p): s.reader for s in (sched.stripes[i] for i in sched.direct)
             for p in range(s.start // page, s.end // page)}
    want = {}
    for f, pages in _needed_pages(plan, sched.ranks, page).items():
        rest = sorted(p for p in pages if (f, p) not in owner)
        runs: list[list[int]] = []
        for p in rest:
            if runs and p == runs[-1][-1] + 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        for run in runs:
            reader = owner.get((f, run[0] - 1), owner.get((f, run[-1] + 1)))
            if len(run) <= EDGE_PAGES and reader is not None:
                want.update({(f, p): reader for p in run})
    got = {(s.file, p): s.reader for i, s in enumerate(sched.stripes) if i not in sched.direct
           for p in range(s.start // page, -(-s.end // page)) if (s.file, p) in want}
    assert got == want
    return {i for i, s in enumerate(sched.stripes) if (s.file, s.start // page) in want}


def _check_requests(sched) -> None:
    """A rank's request runs are its stripes in order, each run adjacent stripes of at most stripe_bytes together,
    and no two runs one after the other could be one."""
    for rank in sched.ranks:
        runs = request_runs(sched, rank)
        assert [i for run in runs for i in run] == list(sched.read_by(rank))
        spans = []
        for run in runs:
            s = [sched.stripes[i] for i in run]
            assert all((a.file, a.end) == (b.file, b.start) for a, b in zip(s, s[1:]))
            assert s[-1].end - s[0].start <= sched.stripe_bytes
            spans.append((s[0].file, s[0].start, s[-1].end))
        for (f, a, b), (g, c, d) in zip(spans, spans[1:]):
            assert not ((f, b) == (g, c) and d - a <= sched.stripe_bytes), "two requests could be one"


@pytest.mark.parametrize("stripe,page", [(64, 64), (96, 32), (1 << 20, 4096), (4096, 4096)])
@pytest.mark.parametrize("tp", (1, 2, 3, 4))
@pytest.mark.parametrize("direct", (False, True))
def test_node_stripes_and_keeps_in_memory(tp, stripe, page, direct):
    ckpt, blob = _checkpoint(SPECS)
    plan = make_plan(ckpt, tp, rules=RULES, preset=None, uneven="pad")
    sched = node_schedule(plan, range(tp), "n", stripe, page, direct=direct)
    assert sched.stripe_bytes == stripe and sched.ranks == tuple(range(tp))
    assert bool(sched.direct) == (direct and tp > 1 and page <= 64), sched.direct  # whole pages in a 1,823-byte file
    _check_node(plan, sched, [blob], page)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 40), cols=st.integers(1, 40), size=st.sampled_from((1, 2, 4)), tp=st.integers(1, 5),
    dim=st.integers(0, 1), page=st.sampled_from((8, 16, 64)), pages=st.integers(1, 5), nodes=st.integers(1, 3),
    direct=st.booleans(),
)
def test_property_node_schedule(rows, cols, size, tp, dim, page, pages, nodes, direct):
    ckpt, blob = _checkpoint({"t": ("U8" if size == 1 else "F16" if size == 2 else "F32", (rows, cols), size),
                              "r": ("U8", (7,), 1)})
    plan = make_plan(ckpt, tp, rules=[("t", Split(dim)), ("r", Replicated())], preset=None, uneven="pad")
    for r0 in range(min(nodes, tp)):
        sched = node_schedule(plan, range(r0, tp, nodes), f"n{r0}", page * pages, page, direct=direct)
        _check_node(plan, sched, [blob], page)


@pytest.mark.parametrize("tp", (2, 4, 8))
def test_node_schedule_of_real_checkpoints(model_dir, tp):
    plan = make_plan(model_dir, tp)
    files = read_files(plan)
    _check_node(plan, node_schedule(plan, range(tp), "n", 8192), files, 4096)
    direct = node_schedule(plan, range(tp), "n", 8192, direct=True)
    assert direct.direct or tp > 2, "a column-parallel block is read straight into its shard"
    _check_node(plan, direct, files, 4096)
    # the partial pages at a block's edges go with the block: fewer requests than stripes
    assert sum(len(request_runs(direct, r)) for r in range(tp)) < len(direct.stripes) or not direct.direct
    # two nodes: each reads only (all of) its own ranks' union
    half = node_schedules(plan, ["a"] * (tp // 2) + ["b"] * (tp - tp // 2), 8192)
    assert [n.node for n in half] == ["a", "b"]
    for n in half:
        _check_node(plan, n, files, 4096)


def test_a_short_run_of_shared_pages_after_a_block_is_read_with_it():
    """A replicated tensor between two column-parallel blocks: its pages (with the blocks' partial pages at its
    ends) are read by the rank of the block before it, in that block's last request, while they are at most
    EDGE_PAGES; past that they are shared out between the readers."""
    page, seen = 16, {}
    for n in range((EDGE_PAGES - 3) * page, (EDGE_PAGES + 2) * page, page // 2):
        ckpt, blob = _checkpoint({"a": ("U8", (2, 8 * page), 1), "r": ("U8", (n,), 1), "b": ("U8", (2, 8 * page), 1)})
        plan = make_plan(ckpt, 2, rules=[("a", Split(0)), ("r", Replicated()), ("b", Split(0))], preset=None)
        sched = node_schedule(plan, range(2), "n", 4 * page, page, direct=True)
        _check_node(plan, sched, [blob], page)
        (r,) = [t.reads[0] for t in plan.ranks[0].tensors if t.name == "r"]
        # the stripes between a's block of rank 1 and b's of rank 0
        block = max(i for i in sched.direct if sched.stripes[i].end <= r.offset)
        after = min(i for i in sched.direct if sched.stripes[i].start >= r.offset + r.length)
        between = sched.stripes[block + 1 : after]
        seen[sum(s.end - s.start for s in between) // page] = {s.reader for s in between}
        if {s.reader for s in between} == {1}:
            assert any(block in run and block + 1 in run for run in request_runs(sched, 1))
    assert seen[EDGE_PAGES] == {1} and seen[EDGE_PAGES + 1] == {0, 1}, seen


def test_replicated_bytes_are_read_once_per_node():
    ckpt, blob = _checkpoint({"rep": ("F32", (64, 64), 4)})  # 16 KiB, every rank keeps all of it
    plan = make_plan(ckpt, 4, rules=[("rep", Replicated())], preset=None)
    sched = node_schedule(plan, range(4), "n", 4096)
    assert sched.nbytes == plan.files[0].size == len(blob)  # the header's page too, once; the last page clipped
    assert [(s.start, s.reader) for s in sched.stripes] == [(0, 0), (4096, 1), (8192, 2), (12288, 3), (16384, 3)]
    for r in range(4):  # every rank keeps every byte, from stripes any reader read
        assert sum(k.part.bytes_needed for k in rank_keeps(plan, sched, r)) == 64 * 64 * 4


def test_node_schedules_round_trip_and_tabulate():
    ckpt, blob = _checkpoint(SPECS)
    plan = make_plan(ckpt, 4, rules=RULES, preset=None, uneven="pad")
    assert plan.nodes == ()
    two = with_node_schedules(plan, ["x", "y", "x", "y"], stripe_bytes=8192)
    assert [n.ranks for n in two.nodes] == [(0, 2), (1, 3)] and two.node_of(3).node == "y"
    assert Plan.from_json(two.to_json()) == two
    rows = node_rows(two)
    assert [(r["node"], r["start"], r["end"], r["reader"]) for r in rows] == [
        (n.node, s.start, s.end, s.reader) for n in two.nodes for s in n.stripes]
    for r in rows:  # keepers: the node's ranks with a keep in the stripe
        n = two.node_of(r["reader"])
        assert r["keepers"] == tuple(sorted({k.rank for rk in n.ranks for k in rank_keeps(two, n, rk)
                                              if k.stripe == r["stripe"]}))
        assert set(r["keepers"]) <= set(n.ranks) and r["keepers"]
    with pytest.raises(KeyError, match="with_node_schedules"):
        plan.node_of(0)
    with pytest.raises(ValueError, match="node id"):
        with_node_schedules(plan, ["x"])


def test_stripe_bytes_must_hold_a_page():
    ckpt, _ = _checkpoint({"a": ("U8", (4,), 1)})
    plan = make_plan(ckpt, 1, rules=[("a", Replicated())], preset=None)
    with pytest.raises(ConfigurationError, match="stripe_bytes"):
        node_schedule(plan, [0], "n", 100)


def test_max_gap_reads_small_gaps_between_needed_pages():
    ckpt, blob = _checkpoint({"row": ("U8", (64, 512), 1)})  # rows of 512 B; each rank keeps 128 B of each
    plan = make_plan(ckpt, 4, rules=[("row", Split(-1))], preset=None)
    exact = node_schedule(plan, [1], "n", 4096, page=64)  # rank 1 alone: one span per row
    assert len(exact.stripes) == 64
    _check_node(plan, exact, [blob], 64)
    wide = node_schedule(plan, [1], "n", 4096, page=64, max_gap=512)
    assert [(s.start, s.end) for s in wide.stripes] == [(a, min(a + 4096, exact.stripes[-1].end))
                                                       for a in range(exact.stripes[0].start, exact.stripes[-1].end, 4096)]
    for sched in (exact, wide):  # the keeps are exactly the reads either way
        keeps = rank_keeps(plan, sched, 1)
        assert sum(k.part.bytes_needed for k in keeps) == plan.ranks[1].stats.bytes_needed
