"""backend="fastsafetensors": shards bit-identical to the ranged backend and to safetensors, the tensor
filter, queue_size, the GDS fallback, and option validation (directly and through Ray)."""

from __future__ import annotations

import json
import logging
import os
import struct

import pytest
import torch

import raylazy
import raylazy.io.fst as fst
from raylazy.core.dtypes import DTYPE_BITS
from raylazy.core.options import QUEUE_SIZE_ENV, ReaderOptions, load_options
from raylazy.core.placements import Replicated, Split
from raylazy.errors import ConfigurationError, FileChangedError, GDSUnavailableError, ReadError
from raylazy.io.ranged import read_rank_ranged
from raylazy.planning import make_plan
from raylazy.storage import read_header
from tests.support.checkpoints import reference_tensors
from tests.support.planlib import as_bytes, reference_shard

QUEUE_SIZES = (-1, 0, 1, 2)


def fst_options(queue_size: int = 0, **kw) -> ReaderOptions:
    return ReaderOptions(backend="fastsafetensors", queue_size=queue_size, **kw)


def assert_same_shards(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), name
        assert g.device.type == "cpu"
        assert as_bytes(g) == as_bytes(w), f"{name}: bytes differ"


@pytest.fixture(scope="module")
def references(llama_dir, qwen2_dir, mixtral_dir) -> dict:
    return {d: reference_tensors(d) for d in (llama_dir, qwen2_dir, mixtral_dir)}


# --- the reader, without Ray ---------------------------------------------------------------


@pytest.mark.parametrize("tp", (1, 2, 4))
@pytest.mark.parametrize("queue_size", QUEUE_SIZES)
def test_shards_match_ranged_and_safetensors(model_dir, references, tp, queue_size):
    plan = make_plan(model_dir, tp)
    full = references[model_dir]
    for rp in plan.ranks:
        progress = []
        shards, stats = fst.read_rank_fastsafetensors(rp, "cpu", options=fst_options(queue_size),
                                                      on_progress=progress.append)
        ranged, rstats = read_rank_ranged(rp, "cpu")
        assert_same_shards(shards, ranged)
        assert_same_shards(shards, {t.name: reference_shard(full[t.name], t) for t in rp.tensors})
        # the shard is its own tensor, not a view of the loader's (freed) buffers
        for t in shards.values():
            assert t.untyped_storage().nbytes() == t.nbytes
        used = sorted({r.file for t in rp.tensors for r in t.reads})
        assert stats.backend == "fastsafetensors" and stats.device == "cpu"
        assert stats.bytes_needed == rstats.bytes_needed == rp.stats.bytes_needed == sum(progress)
        assert len(progress) == len([t for t in rp.tensors if t.reads])  # one call per tensor
        whole = sum(full[t.name].nbytes for t in rp.tensors)
        assert whole <= stats.bytes_read <= whole + 4096 * stats.requests  # whole tensors, small gaps merged
        assert len(used) <= stats.requests <= len([t for t in rp.tensors if t.reads])  # byte runs, not files
        assert stats.gds is False and stats.gds_fallback == "" and stats.bytes_received == 0
        depth = min(len(used), 1 if queue_size == -1 else queue_size + 2)
        assert stats.staging_buffers == depth
        data = sorted((f.size - 8 - read_header(f.uri).header_len for f in (plan.files[i] for i in used)),
                      reverse=True)
        assert stats.staging_bytes == sum(data[:depth]) > 0
        assert stats.seconds > 0


def _write_file(path, specs: dict) -> str:
    """One safetensors file of raw tensors {name: (dtype, shape)} with patterned bytes."""
    header, data = {}, b""
    for name, (dtype, shape) in specs.items():
        numel = 1
        for d in shape:
            numel *= d
        blob = bytes((len(data) * 7 + i * 197) % 251 for i in range(numel * DTYPE_BITS[dtype] // 8))
        if dtype == "BOOL":
            blob = bytes(b & 1 for b in blob)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    return str(path)


DTYPE_SPECS = {
    "f8": ("F8_E4M3", (6, 8)), "f4": ("F4", (4, 12)), "i32": ("I32", (5, 3)), "b": ("BOOL", (4, 4)),
    "scalar": ("F32", ()), "empty": ("BF16", (0, 4)), "u16": ("U16", (8,)), "e8": ("F8_E8M0", (4, 2)),
}
DTYPE_RULES = [("f8", Split(0)), ("f4", Split(-1)), ("i32", Split(1)), ("b", Split(0)), ("scalar", Replicated()),
               ("empty", Split(1)), ("u16", Split(0)), ("e8", Replicated())]


@pytest.mark.parametrize("tp", (1, 2, 3))
def test_other_dtypes_padding_scalars_and_empty_tensors(tmp_path, tp):
    """fp8, packed F4 (uint8 rows, as `typed` says), bool, ints, a scalar, an empty tensor, padded shards."""
    d = _write_file(tmp_path / "dt", DTYPE_SPECS)
    plan = make_plan(d, tp, rules=DTYPE_RULES, preset=None, uneven="pad")
    for rp in plan.ranks:
        shards, stats = fst.read_rank_fastsafetensors(rp, "cpu", options=fst_options(1))
        ranged, rstats = read_rank_ranged(rp, "cpu")
        assert_same_shards(shards, ranged)
        assert stats.bytes_needed == rstats.bytes_needed


def test_tensors_fastsafetensors_cannot_read_are_refused_up_front(tmp_path):
    d = _write_file(tmp_path / "odd", {"ok": ("BF16", (4, 4)), "f4": ("F4", (2, 1)), "c": ("C64", (2,))})
    plan = make_plan(d, 1, rules=[("*", Replicated())], preset=None)
    with pytest.raises(ConfigurationError, match="backend='ranged'") as e:
        fst.read_rank_fastsafetensors(plan.ranks[0], "cpu", options=fst_options())
    assert "'f4'" in str(e.value) and "'c'" in str(e.value)


@pytest.mark.ray
def test_load_refuses_what_fastsafetensors_cannot_read_on_the_driver(tmp_path, ray_local):
    """The backend's check runs on the driver: a ConfigurationError, not a RankFailedError from the ranks."""
    from raylazy.errors import RankFailedError
    from tests.support.raytest import assert_no_leaks, live

    d = _write_file(tmp_path / "odd", {"ok": ("BF16", (4, 4)), "c": ("C64", (2,))})
    before = live()
    with pytest.raises(ConfigurationError, match="backend='ranged'") as e:
        raylazy.load(d, 2, rules=[("*", Replicated())], preset=None, backend="fastsafetensors", device="cpu",
                     progress=False)
    assert not isinstance(e.value, RankFailedError) and "'c'" in str(e.value)
    assert_no_leaks(before, "a plan the backend cannot read")


def test_filter_keeps_unneeded_tensors_unread(llama_dir, monkeypatch):
    """A rank needing a third of the tensors gets only those from the loader, and their bytes alone are read."""
    import fastsafetensors
    from fastsafetensors.copier.nogds import NoGdsFileCopier

    plan = make_plan(llama_dir, 2)
    full_rank = plan.ranks[1]
    rp = full_rank.model_copy(update={"tensors": full_rank.tensors[::3]})
    wanted = {t.name for t in rp.tensors}
    asked, yielded, runs = {}, [], {}
    real_loader, real_ranges = fastsafetensors.ParallelLoader, NoGdsFileCopier.set_byte_ranges

    class SpyLoader(real_loader):
        def __init__(self, pg, files, **kw):
            inner = kw["tensor_filter"]

            def spy(name):
                asked[name] = inner(name)
                return asked[name]

            super().__init__(pg, files, **{**kw, "tensor_filter": spy})

        def iterate_weights(self):
            for name, t in super().iterate_weights():
                yielded.append(name)
                yield name, t

    def spy_ranges(self, byte_ranges):
        runs[self.metadata.src] = list(byte_ranges or [])
        return real_ranges(self, byte_ranges)

    monkeypatch.setattr(fastsafetensors, "ParallelLoader", SpyLoader)
    monkeypatch.setattr(NoGdsFileCopier, "set_byte_ranges", spy_ranges)
    shards, stats = fst.read_rank_fastsafetensors(rp, "cpu", options=fst_options(0))

    assert sorted(yielded) == sorted(wanted)  # only the rank's tensors are materialised, each once
    assert {n for n, keep in asked.items() if keep} == wanted
    assert len(asked) > len(wanted)  # the filter was asked about the others, and said no
    full = reference_tensors(llama_dir)
    assert_same_shards(shards, {t.name: reference_shard(full[t.name], t) for t in rp.tensors})
    assert sum(full[n].nbytes for n in wanted) <= stats.bytes_read < sum(t.nbytes for t in full.values())
    used = {plan.files[r.file].uri for t in rp.tensors for r in t.reads}
    assert set(runs) == used  # files with none of the rank's tensors are not even opened
    # the statistics count exactly the byte runs fastsafetensors read
    assert stats.requests == sum(len(r) for r in runs.values()) > len(used)
    assert stats.bytes_read == sum(hi - lo for r in runs.values() for lo, hi in r)
    for path in used:  # no byte of an unneeded tensor is read unless it sits inside a <=4 KiB merge gap
        for info in read_header(path).tensors:
            inside = [(lo, hi) for lo, hi in runs[path] if lo < info.end and info.start < hi]
            if info.name in wanted:
                assert any(lo <= info.start and info.end <= hi for lo, hi in inside), info.name
            elif info.end - info.start > 4096:
                assert not inside, f"{info.name} was read"


def test_rank_without_reads_needs_no_loader(tmp_path, monkeypatch):
    import fastsafetensors

    d = _write_file(tmp_path / "e", {"empty": ("BF16", (0, 4)), "scalar": ("F32", ())})
    plan = make_plan(d, 2, rules=[("empty", Split(1)), ("scalar", Replicated())], preset=None)
    rp = plan.ranks[0].model_copy(update={"tensors": plan.ranks[0].tensors[:1]})
    monkeypatch.setattr(fastsafetensors, "ParallelLoader", None)  # would fail if used
    shards, stats = fst.read_rank_fastsafetensors(rp, "cpu", options=fst_options())
    assert tuple(shards["empty"].shape) == (0, 2) and stats.bytes_needed == stats.requests == 0


def test_changed_file_is_refused_before_loading(llama_dir, tmp_path):
    import shutil

    d = shutil.copytree(llama_dir, tmp_path / "m")
    plan = make_plan(d, 2)
    path = plan.files[0].uri
    with open(path, "r+b") as f:  # same size, different header: "{" becomes " "
        f.seek(8)
        assert f.read(1) == b"{"
        f.seek(8)
        f.write(b" ")
    with pytest.raises(FileChangedError):
        fst.read_rank_fastsafetensors(plan.ranks[0], "cpu", options=fst_options())


# --- GDS: which devices use it, and the fallback ---------------------------------------------


def test_gds_is_wanted_only_on_cuda_and_only_unless_nogds():
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    assert not fst._want_gds(None, cpu) and not fst._want_gds(False, cpu) and not fst._want_gds(True, cpu)
    assert fst._want_gds(None, cuda) and fst._want_gds(False, cuda) and not fst._want_gds(True, cuda)


def test_driver_turns_gds_off_for_ranks_sharing_a_node():
    from raylazy.core.choices import choose_backend

    def nogds(reader: ReaderOptions, peers: int):
        return choose_backend(reader.backend, peers, "cuda:0", True, reader.nogds).nogds

    fopts = fst_options()
    assert nogds(fopts, 2) is True
    assert nogds(fopts, 1) is None  # alone: the rank decides (GDS on CUDA)
    assert nogds(fst_options(nogds=False), 4) is False  # explicit choice kept
    assert nogds(ReaderOptions(), 4) is None  # ranged: untouched


@pytest.mark.parametrize("message", [
    "[FAIL] init_gds()",
    "is_gds_supported(0) failed",
    "submit_io: register_buffer failed, offset=0, length=4096",
    "wait_io: wait_gds_read failed, request=3",
    "init_gds: cuFileDriverOpen returned an error = 5027",
])
def test_gds_unavailable_messages(message):
    assert fst._is_gds_unavailable(Exception(message))
    assert fst._is_gds_unavailable(RuntimeError(message))
    wrapped = ValueError("load failed")
    wrapped.__cause__ = RuntimeError(message)
    assert fst._is_gds_unavailable(wrapped)


@pytest.mark.parametrize("exc", [
    Exception("wait_io: wait_nogds_read failed, reqs=[1]"),
    ValueError("tensor x includes unread bytes"),
    OSError(2, "No such file or directory"),
    FileChangedError("/m/a.safetensors: header differs (not cuFile related)"),
    MemoryError(),
])
def test_other_errors_are_not_gds_unavailable(exc):
    assert not fst._is_gds_unavailable(exc)
    assert fst._is_gds_unavailable(GDSUnavailableError("no nvidia-fs"))


class _GdsLoaderFake:
    """Wraps fastsafetensors.ParallelLoader: with nogds=False it fails as told (at start, or after a tensor)."""

    def __init__(self, error: BaseException, after_first: bool = False):
        import fastsafetensors

        self.real, self.error, self.after_first, self.calls = fastsafetensors.ParallelLoader, error, after_first, []

    def __call__(self, pg, files, **kw):
        self.calls.append(kw["nogds"])
        if not kw["nogds"] and not self.after_first:
            raise self.error
        loader = self.real(pg, files, **{**kw, "nogds": True})
        if not kw["nogds"]:
            real_iter, error = loader.iterate_weights, self.error

            def failing():
                it = real_iter()
                try:
                    yield next(it)
                finally:
                    it.close()
                raise error

            loader.iterate_weights = failing
        return loader


@pytest.fixture
def pretend_gds(monkeypatch, caplog):
    """Make the reader try GDS on the CPU (as it would on a lone CUDA rank), with a fresh process state."""
    monkeypatch.setattr(fst, "_want_gds", lambda nogds, dev: nogds is not True)
    monkeypatch.setattr(fst, "_gds_broken", False)
    caplog.set_level(logging.WARNING, logger="raylazy")
    return caplog


@pytest.mark.parametrize("after_first", (False, True), ids=("at-start", "mid-load"))
def test_gds_unavailable_falls_back_to_nogds_with_one_warning(llama_dir, monkeypatch, pretend_gds, after_first):
    import fastsafetensors

    fake = _GdsLoaderFake(Exception("[FAIL] init_gds()"), after_first)
    monkeypatch.setattr(fastsafetensors, "ParallelLoader", fake)
    rp = make_plan(llama_dir, 2).ranks[1]
    progress = []
    shards, stats = fst.read_rank_fastsafetensors(rp, "cpu", options=fst_options(1), on_progress=progress.append)
    assert fake.calls == [False, True]
    assert_same_shards(shards, read_rank_ranged(rp, "cpu")[0])
    warnings = [r for r in pretend_gds.records if r.levelno >= logging.WARNING and r.name == "raylazy"]
    assert len(warnings) == 1 and "GPUDirect Storage is unavailable" in warnings[0].getMessage()
    assert "init_gds" in stats.gds_fallback and stats.gds is False
    assert sum(progress) == stats.bytes_needed == rp.stats.bytes_needed  # the failed attempt is taken back
    if after_first:
        assert any(n < 0 for n in progress)

    # the process now knows GDS is broken: the next load goes straight to nogds, silently
    pretend_gds.clear()
    fake.calls.clear()
    fst.read_rank_fastsafetensors(rp, "cpu", options=fst_options(1))
    assert fake.calls == [True] and not pretend_gds.records


@pytest.mark.parametrize("after_first", (False, True), ids=("at-start", "mid-load"))
def test_other_errors_on_the_gds_path_are_not_retried(llama_dir, monkeypatch, pretend_gds, after_first):
    """An error that is not GDS's propagates without a retry: as it is at the start, named as a ReadError (the
    file, the tensor waited for, it as the cause) once tensors come."""
    import fastsafetensors

    error = ValueError("tensor model.norm.weight includes unread bytes")
    fake = _GdsLoaderFake(error, after_first)
    monkeypatch.setattr(fastsafetensors, "ParallelLoader", fake)
    with pytest.raises(ReadError if after_first else ValueError) as e:
        fst.read_rank_fastsafetensors(make_plan(llama_dir, 2).ranks[0], "cpu", options=fst_options())
    assert (e.value.__cause__ if after_first else e.value) is error and fake.calls == [False]  # no retry
    assert not after_first or ".safetensors" in str(e.value) and "unread bytes" in str(e.value)
    assert not [r for r in pretend_gds.records if r.levelno >= logging.WARNING]
    assert fst._gds_broken is False


def test_gds_error_on_the_nogds_retry_propagates(llama_dir, monkeypatch, pretend_gds):
    import fastsafetensors

    calls = []

    def always_fails(pg, files, **kw):
        calls.append(kw["nogds"])
        raise RuntimeError("submit_io: register_buffer failed, offset=0, length=4096")

    monkeypatch.setattr(fastsafetensors, "ParallelLoader", always_fails)
    with pytest.raises(RuntimeError, match="register_buffer"):
        fst.read_rank_fastsafetensors(make_plan(llama_dir, 1).ranks[0], "cpu", options=fst_options())
    assert calls == [False, True]  # one retry, no loop


def test_loader_is_closed_on_failure(llama_dir, monkeypatch):
    import fastsafetensors

    real, closed = fastsafetensors.ParallelLoader, []

    class Closing(real):
        def close(self):
            closed.append(True)
            super().close()

    def broken_cut(*a, **k):
        raise ReadError("boom")

    monkeypatch.setattr(fastsafetensors, "ParallelLoader", Closing)
    monkeypatch.setattr(fst, "_cut", broken_cut)
    with pytest.raises(ReadError, match="boom"):
        fst.read_rank_fastsafetensors(make_plan(llama_dir, 2).ranks[0], "cpu", options=fst_options(2))
    assert closed == [True]


# --- options: queue_size validation and the environment variable -------------------------------


@pytest.fixture
def no_actors(monkeypatch):
    """Fail the test if raylazy.load gets as far as starting Ray or creating actors."""
    import ray

    import raylazy.cluster.loader

    def started(*a, **k):
        raise AssertionError("an actor was started for invalid options")

    monkeypatch.setattr(raylazy.cluster.loader.RankGroup, "create", started)
    if not ray.is_initialized():
        monkeypatch.setattr(ray, "init", started)


@pytest.mark.parametrize("bad", (-2, "1", 1.5, 65, True))
def test_bad_queue_size_refused_before_any_actor(llama_dir, no_actors, monkeypatch, bad):
    monkeypatch.delenv(QUEUE_SIZE_ENV, raising=False)
    with pytest.raises(ConfigurationError, match="queue_size"):
        raylazy.load(llama_dir, tp=2, backend="fastsafetensors", device="cpu", queue_size=bad)


@pytest.mark.parametrize("env", ("abc", "1.5", "-2", "", "100"))
def test_bad_env_queue_size_refused_before_any_actor(llama_dir, no_actors, monkeypatch, env):
    monkeypatch.setenv(QUEUE_SIZE_ENV, env)
    with pytest.raises(ConfigurationError, match="queue_size|" + QUEUE_SIZE_ENV):
        raylazy.load(llama_dir, tp=2, backend="fastsafetensors", device="cpu")


def test_env_queue_size_honoured_and_argument_wins(monkeypatch):
    monkeypatch.setenv(QUEUE_SIZE_ENV, "3")
    assert load_options(tp=2, backend="fastsafetensors").reader.queue_size == 3
    assert load_options(tp=2, backend="fastsafetensors", queue_size=None).reader.queue_size == 3
    assert load_options(tp=2, backend="fastsafetensors", queue_size=-1).reader.queue_size == -1
    assert load_options(tp=2, backend="fastsafetensors", queue_size=0).reader.queue_size == 0
    assert load_options(tp=2, backend="ranged").reader.queue_size == 0  # the variable is fastsafetensors'
    monkeypatch.setenv(QUEUE_SIZE_ENV, "garbage")
    assert load_options(tp=2, backend="fastsafetensors", queue_size=1).reader.queue_size == 1  # not even read


# --- through Ray -----------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.parametrize("queue_size", (-1, "env=2"))
def test_load_through_ray_matches_ranged(llama_dir, ray_local, monkeypatch, queue_size):
    """Two loads (each starts two actors): queue_size=-1 as an argument, and 2 from the environment."""
    kwargs = {}
    if queue_size == "env=2":
        monkeypatch.setenv(QUEUE_SIZE_ENV, "2")
    else:
        monkeypatch.setenv(QUEUE_SIZE_ENV, "garbage")  # the argument wins; the variable is not even read
        kwargs["queue_size"] = queue_size
    with raylazy.load(llama_dir, tp=2, backend="fastsafetensors", device="cpu", progress=False, **kwargs) as m:
        expected_q = 2 if queue_size == "env=2" else queue_size
        assert m.options.reader.queue_size == expected_q
        for rank, rp in enumerate(m.plan.ranks):
            assert_same_shards(m.get(rank), read_rank_ranged(rp, "cpu")[0])
            s = m.stats[rank]
            used = {r.file for t in rp.tensors for r in t.reads}
            assert s.backend == "fastsafetensors" and s.staging_buffers == min(len(used), max(1, expected_q + 2))
            assert s.gds is False and s.bytes_needed == rp.stats.bytes_needed
