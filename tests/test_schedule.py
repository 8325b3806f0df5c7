"""The schedule (raylazy.schedule) without I/O: windows tile each shard, their parts cover every needed
byte exactly once and reproduce the plan's reads, sizes respect chunk_bytes, padding is flagged; and
the per-node grouping of ranks."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from raylazy.checkpoint import Checkpoint, ModelConfig
from raylazy.header import parse_header
from raylazy.placements import Fused, Replicated, Split
from raylazy.planner import make_plan
from raylazy.schedule import RankSchedule, group_by_node, rank_schedule

from planlib import apply_reads


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
