"""Readers fill caller-supplied tensors in place (`out=`): bit-for-bit against safetensors get_tensor +
narrow, the caller's own tensor objects come back, padding is zeroed, and a buffer that does not match
its shard is refused before any byte is read. And the ranged reader's windows (`raylazy.io.ranged`): windows that
start inside strided reads, rows gathered with their gaps, rows asked of cold storage ahead, staging buffers."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

import raylazy.io.fst as fst
from raylazy.core.options import ReaderOptions
from raylazy.core.placements import Replicated, Split
from raylazy.core.schedule import rank_schedule
from raylazy.errors import BufferMismatchError, RaylazyError
from raylazy.io.buffers import plan_files
from raylazy.io.ranged import read_rank_ranged
from raylazy.planning import make_plan
from raylazy.storage import open_planned_files
from tests.support.checkpoints import reference_tensors
from tests.support.measured import PAGE
from tests.support.planlib import as_bytes, reference_shard

GARBAGE = 0x5A


def _read(backend: str, rp, **kw):
    if backend == "fastsafetensors":
        return fst.read_rank_fastsafetensors(rp, "cpu", options=ReaderOptions(backend="fastsafetensors"), **kw)
    return read_rank_ranged(rp, "cpu", options=ReaderOptions(chunk_bytes=4096), stage=backend == "ranged-staged", **kw)


BACKENDS = ("ranged", "ranged-staged", "fastsafetensors")


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory) -> str:
    """One safetensors file (written by safetensors) of several dtypes, with dims tp=3 does not divide."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "emb": torch.randn(10, 16, generator=g).to(torch.bfloat16),       # Split(0), padded at tp=3
        "row": torch.randn(6, 300, generator=g),                           # Split(-1): one range per row
        "ids": torch.randint(-1000, 1000, (7, 5), generator=g, dtype=torch.int32),  # Split(1), padded
        "norm": torch.randn(33, generator=g).to(torch.float16),           # replicated
    }
    d = tmp_path_factory.mktemp("mixed")
    save_file(tensors, os.path.join(d, "model.safetensors"))
    return str(d)


RULES = [("emb", Split(0)), ("row", Split(-1)), ("ids", Split(1)), ("norm", Replicated())]


def _garbage_like(t) -> torch.Tensor:
    x = torch.empty(t.shape, dtype=t.dtype)
    if x.numel():
        x.view(-1).view(torch.uint8).fill_(GARBAGE)
    return x


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_is_filled_in_place_and_returned(mixed_dir, backend):
    plan = make_plan(mixed_dir, 3, rules=RULES, preset=None, uneven="pad")
    full = reference_tensors(mixed_dir)
    for rp in plan.ranks:
        want = {t.name: reference_shard(full[t.name], t) for t in rp.tensors}
        given = {n: _garbage_like(w) for n, w in want.items() if n != "norm"}  # "norm" left to the reader
        ptrs = {n: t.data_ptr() for n, t in given.items()}
        shards, stats = _read(backend, rp, out=given)
        assert list(shards) == [t.name for t in rp.tensors]
        for name, w in want.items():
            assert shards[name].dtype == w.dtype and tuple(shards[name].shape) == tuple(w.shape)
            assert as_bytes(shards[name]) == as_bytes(w), f"rank {rp.rank} {backend}: {name} differs"
            if name in given:  # the caller's tensor itself, filled (padding zeroed over the garbage)
                assert shards[name] is given[name] and shards[name].data_ptr() == ptrs[name]
        assert shards["norm"].data_ptr() not in ptrs.values()
        assert stats.bytes_needed == rp.stats.bytes_needed
    assert any(t.bytes_needed < t.nbytes for rp in plan.ranks for t in rp.tensors)  # padding was exercised


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_may_be_a_view_into_a_larger_buffer(mixed_dir, backend):
    """A contiguous view at an offset of a bigger tensor (e.g. one parameter of a flat arena)."""
    rp = make_plan(mixed_dir, 2, rules=RULES, preset=None, uneven="pad").ranks[1]
    full = reference_tensors(mixed_dir)
    t = next(t for t in rp.tensors if t.name == "row")
    arena = torch.full((3, *t.shape), 7.0)
    target = arena[1]
    shards, _ = _read(backend, rp, out={"row": target})
    assert shards["row"] is target
    assert as_bytes(arena[1]) == as_bytes(reference_shard(full["row"], t))
    assert bool((arena[0] == 7).all()) and bool((arena[2] == 7).all())  # nothing outside the view touched


def _refused(mixed_dir, backend, monkeypatch, bad: dict, *expected: str) -> None:
    rp = make_plan(mixed_dir, 3, rules=RULES, preset=None, uneven="pad").ranks[0]
    opened = []
    real_open = os.open

    def spy_open(path, flags, *a, **k):
        opened.append(os.fspath(path))
        return real_open(path, flags, *a, **k)

    emb = next(t for t in rp.tensors if t.name == "emb")
    good = _garbage_like(reference_shard(reference_tensors(mixed_dir)["emb"], emb))
    monkeypatch.setattr(os, "open", spy_open)
    with pytest.raises(BufferMismatchError) as info:
        _read(backend, rp, out={"emb": good, **bad})
    monkeypatch.undo()
    assert isinstance(info.value, RaylazyError)
    for text in expected:
        assert text in str(info.value), str(info.value)
    assert not [p for p in opened if p.endswith(".safetensors")], "a checkpoint file was opened"
    assert bool((good.view(-1).view(torch.uint8) == GARBAGE).all())  # nothing written either


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_shape_dtype_device_layout_refused_before_reading(mixed_dir, backend, monkeypatch):
    rp = make_plan(mixed_dir, 3, rules=RULES, preset=None, uneven="pad").ranks[0]
    shape = next(t.shape for t in rp.tensors if t.name == "row")  # (6, 100)
    _refused(mixed_dir, backend, monkeypatch, {"row": torch.empty(6, 99)}, "'row'", "[6, 100]", "[6, 99]")
    _refused(mixed_dir, backend, monkeypatch, {"row": torch.empty(shape, dtype=torch.float16)},
             "'row'", "torch.float32", "torch.float16")
    _refused(mixed_dir, backend, monkeypatch, {"row": torch.empty(100, 6).t()}, "'row'", "not contiguous")
    _refused(mixed_dir, backend, monkeypatch, {"row": torch.empty(shape, device="meta")}, "'row'", "meta")
    _refused(mixed_dir, backend, monkeypatch, {"nope": torch.empty(1)}, "'nope'", "does not hold")


# --- the ranged reader's windows --------------------------------------------------------------------------------

#: Window size of these tests: each rank's shards span several windows, and windows start inside strided reads.
CHUNK = 16384
TP = 4


@pytest.fixture(scope="module")
def rows_dir(tmp_path_factory) -> str:
    """Tensors of many rows, split at tp=4: column-split rows whose pages touch (400 bytes, 1,600 apart; the first
    in the file's first page, beside the header), column-split rows pages apart (4 KiB, 16 KiB apart), and rows
    split whole (each rank's a contiguous range of two windows)."""
    g = torch.Generator().manual_seed(7)
    tensors = {
        "a_touching": torch.randn(96, 400, generator=g),
        "b_apart": torch.randn(24, 4096, generator=g),
        "c_whole": torch.randn(256, 100, generator=g),
    }
    d = tmp_path_factory.mktemp("rows")
    save_file(tensors, os.path.join(d, "model.safetensors"))
    return str(d)


ROW_RULES = [("a_touching", Split(-1)), ("b_apart", Split(-1)), ("c_whole", Split(0))]
ROW_DIMS = {"a_touching": -1, "b_apart": -1, "c_whole": 0}


def _rows_plan(rows_dir: str, max_gap: int = 0):
    return make_plan(rows_dir, TP, rules=ROW_RULES, preset=None, max_gap=max_gap)


def _check_rows(rows_dir: str, rank: int, shards: dict) -> None:
    """Each shard is the rank's quarter of safetensors' tensor along its split dim."""
    full = reference_tensors(rows_dir)
    assert shards.keys() == full.keys()
    for name, t in full.items():
        want = torch.tensor_split(t, TP, dim=ROW_DIMS[name])[rank]
        assert as_bytes(shards[name]) == as_bytes(want), (rank, name)


@pytest.mark.parametrize("stage", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("max_gap", [0, 1 << 20], ids=["row-by-row", "gathered"])
def test_ranged_windows_starting_inside_strided_reads_place_every_row(rows_dir, stage, max_gap):
    """Rows read one by one (local files) or gathered with the gaps between them (`max_gap`: as on object storage),
    each window holding a run of rows from the middle of its read: every shard bit-for-bit."""
    plan = _rows_plan(rows_dir, max_gap)
    strided = [r for rp in plan.ranks for t in rp.tensors for r in t.reads if r.count > 1]
    assert strided and all(r.gather == bool(max_gap) for r in strided)
    for rp in plan.ranks:
        firsts = [first for w in rank_schedule(rp, CHUNK).windows for r, first, n in w.parts if r.count > 1 and n > 1]
        assert any(firsts) and 0 in firsts  # windows of several rows, some starting inside their read
        shards, _ = read_rank_ranged(rp, "cpu", options=ReaderOptions(chunk_bytes=CHUNK), stage=stage)
        _check_rows(rows_dir, rp.rank, shards)


def _hints_ahead(rp, chunk: int) -> list[tuple[int, int, int]]:
    """What a rank reading cold storage asks for ahead of each window's reads, as (file, start, end): each
    contiguous range whole; each strided read's rows in runs whose pages touch, one request a run (so no page no
    row needs, and no run cut in two)."""
    out = []
    for w in rank_schedule(rp, chunk).windows:
        for r, first, n in w.parts:
            if r.count == 1:
                out.append((r.file, r.offset + first, r.offset + first + n))
                continue
            runs: list[list[int]] = []
            for i in range(first, first + n):
                start, end = r.offset + i * r.stride, r.offset + i * r.stride + r.length
                if runs and start // PAGE <= (runs[-1][1] - 1) // PAGE + 1:
                    runs[-1][1] = end
                else:
                    runs.append([start, end])
            out += [(r.file, start, end) for start, end in runs]
    return out


def test_ranged_asks_cold_storage_for_exactly_the_pages_of_each_window_ahead(rows_dir):
    """Storage that copies nothing without waiting (`try_readinto` 0: a cold cache, or storage that cannot tell)
    is told each window's ranges ahead (`will_need`), rows merged into runs where their pages touch; the rows are
    then read waiting, and every shard is exact."""
    plan = _rows_plan(rows_dir)
    for rp in plan.ranks:
        hints: list[tuple[int, int, int]] = []
        with open_planned_files(rp, plan_files(rp)) as sources:
            for f, source in sources.items():
                source.try_readinto = lambda offset, buffer: 0
                source.will_need = lambda start, end, f=f, hints=hints: hints.append((f, start, end))
            shards, _ = read_rank_ranged(rp, "cpu", options=ReaderOptions(chunk_bytes=CHUNK), sources=sources)
        _check_rows(rows_dir, rp.rank, shards)
        want = _hints_ahead(rp, CHUNK)
        assert any(r.offset < PAGE for t in rp.tensors for r in t.reads if r.count > 1)  # a run from the first page
        assert Counter(hints) == Counter(want), rp.rank


def test_ranged_staging_holds_queue_size_plus_two_windows(rows_dir):
    """Staged, a rank's reads go through queue_size + 2 buffers of one window each, as its stats say."""
    for queue_size in (-1, 0, 1, 2, 5):
        rp = _rows_plan(rows_dir).ranks[1]
        window = rank_schedule(rp, CHUNK).window_bytes
        options = ReaderOptions(chunk_bytes=CHUNK, queue_size=queue_size)
        shards, stats = read_rank_ranged(rp, "cpu", options=options, stage=True)
        _check_rows(rows_dir, rp.rank, shards)
        assert (stats.staging_buffers, stats.staging_bytes) == (queue_size + 2, (queue_size + 2) * window), queue_size


def test_ranged_stages_for_other_devices_with_plain_copies(rows_dir):
    """Only a CUDA device gets a copy stream of its own: another device (here "meta", as "mps" or "xpu") is staged
    with plain copies."""
    rp = _rows_plan(rows_dir).ranks[0]
    shards, stats = read_rank_ranged(rp, "meta", options=ReaderOptions(chunk_bytes=CHUNK))
    assert stats.staging_buffers == 2 and stats.device == "meta"
    assert {n: (t.device.type, tuple(t.shape)) for n, t in shards.items()} == \
        {t.name: ("meta", tuple(t.shape)) for t in rp.tensors}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ranged_on_a_gpu_copies_windows_through_its_stream_bit_for_bit(rows_dir):
    """On a GPU, windows through pinned buffers and the copy stream, refilled once their copies are done, at every
    depth (queue_size -1: one buffer)."""
    for queue_size in (-1, 0, 2):
        for rp in _rows_plan(rows_dir).ranks:
            options = ReaderOptions(chunk_bytes=CHUNK, queue_size=queue_size)
            shards, stats = read_rank_ranged(rp, "cuda", options=options)
            assert stats.staging_buffers == queue_size + 2
            _check_rows(rows_dir, rp.rank, {n: t.cpu() for n, t in shards.items()})
