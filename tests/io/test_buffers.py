"""Readers fill caller-supplied tensors in place (`out=`): bit-for-bit against safetensors get_tensor +
narrow, the caller's own tensor objects come back, padding is zeroed, and a buffer that does not match
its shard is refused before any byte is read."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

import raylazy.io.fst as fst
from raylazy.core.options import ReaderOptions
from raylazy.core.placements import Replicated, Split
from raylazy.errors import BufferMismatchError, RaylazyError
from raylazy.io.ranged import read_rank_ranged
from raylazy.planning import make_plan
from tests.support.checkpoints import reference_tensors
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
