"""Checkpoint files that change or fail under the reader: a rank's read fails with a named error (FileChangedError,
ReadError) naming the file and a tensor, in the reader alone (no Ray) and inside the rank actors, and a failed
load or reload leaves nothing half-loaded."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from raylazy.core.options import ReaderOptions
from raylazy.errors import FileChangedError, NoShardsError, RankFailedError, ReadError
from raylazy.io.ranged import read_rank_ranged
from tests.support.faults import (
    faulty_loader,
    names_a_tensor,
    plan_and_file,
    preadv_fault,
    tensors_of,
)
from tests.support.raytest import (
    assert_no_leaks,
    check_rank,
    live,
    load_with,
)


@pytest.mark.parametrize("change", ["truncated", "grown", "same_size_other_header", "deleted", "fifo"])
def test_file_changed_after_planning(llama_copy, change):
    plan, rp, fi = plan_and_file(llama_copy)
    path = rp.files[fi].uri
    if change == "truncated":
        os.truncate(path, os.path.getsize(path) - 1)
    elif change == "grown":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif change == "same_size_other_header":
        # swap one letter of the header for another: the size is the same, the header digest is not
        with open(path, "r+b") as f:
            n = int.from_bytes(f.read(8), "little")
            header = f.read(n)
            pos = header.index(b"weight")
            f.seek(8 + pos)
            f.write(b"W")
    elif change == "deleted":
        os.unlink(path)
    else:
        os.unlink(path)
        os.mkfifo(path)
    expected = ReadError if change == "deleted" else FileChangedError
    result: dict = {}

    def go():
        try:
            result["value"] = read_rank_ranged(rp, "cpu")
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # blocked opening a FIFO: unblock it before failing
        with open(path, "wb"):
            pass
        pytest.fail("read_rank_ranged blocked on a FIFO that replaced a planned file")
    err = result.get("error")
    assert isinstance(err, expected), result
    assert path in str(err)
    assert names_a_tensor(str(err), tensors_of(rp, fi)), f"no tensor named in: {err}"


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("kind", ["eio", "truncate"])
def test_file_fails_during_reading(llama_copy, kind, stage):
    """EIO or a truncation half-way through the reads: ReadError naming the file and a tensor, no result."""
    plan, rp, fi = plan_and_file(llama_copy)
    options = ReaderOptions(threads=2, chunk_bytes=4096)
    with preadv_fault(None) as counted:
        read_rank_ranged(rp, "cpu", options=options, stage=stage)
    assert counted["calls"] >= 2, counted
    progress = []
    with preadv_fault(kind, after=counted["calls"] // 2) as state, pytest.raises(ReadError) as info:
        read_rank_ranged(rp, "cpu", options=options, on_progress=progress.append, stage=stage)
    err = str(info.value)
    assert state["fired"] and state["fired"] in err, (state, err)
    assert sum(progress) > 0, "the fault should hit part-way through the read"
    assert sum(progress) < rp.stats.bytes_needed
    names = {t.name for t in rp.tensors}
    assert names_a_tensor(err, names), err
    assert ("Input/output error" in err) if kind == "eio" else ("truncated" in err)


def test_open_fails_with_permission_denied(llama_copy, monkeypatch):
    """Tests run as root, so EACCES is simulated: os.open of one planned file raises PermissionError."""
    plan, rp, fi = plan_and_file(llama_copy)
    path, real_open = rp.files[fi].uri, os.open

    def fake_open(p, flags, *args, **kwargs):
        if os.fspath(p) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    with pytest.raises(ReadError) as info:
        read_rank_ranged(rp, "cpu")
    assert path in str(info.value) and "Permission denied" in str(info.value)
    assert names_a_tensor(str(info.value), tensors_of(rp, fi)), str(info.value)


def test_file_replaced_by_rename_while_reading_keeps_the_planned_bytes(llama_copy, llama_dir):
    """Promise: an open file is read to the end even if a new file is renamed over its path
    (the reader holds the planned inode); the shards are those of the planned file."""
    plan, rp, fi = plan_and_file(llama_copy)
    path = rp.files[fi].uri
    other = path + ".new"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-64:] = bytes(64)  # other tensor bytes, same header
    with open(other, "wb") as f:
        f.write(data)
    real = os.preadv
    calls = [0]

    def preadv(fd, buffers, offset, *args):
        calls[0] += 1
        if calls[0] == 2:
            os.replace(other, path)
        return real(fd, buffers, offset, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "preadv", preadv)
        shards, _ = read_rank_ranged(rp, "cpu", options=ReaderOptions(threads=1))
    assert calls[0] > 2
    check_rank(rp, shards, llama_dir)  # the original bytes, not the replacement's


# --- 3 (Ray). reader failures inside the actors -------------------------------------------------------


@pytest.mark.ray
def test_read_error_in_a_rank_fails_the_load_and_releases(llama_copy, ray_local):
    plan, rp, fi = plan_and_file(llama_copy, rank=1)
    before = live()
    with pytest.raises(RankFailedError) as info:
        load_with(faulty_loader(1, "eio", 3), llama_copy, 2, device="cpu", progress=False, backend="ranged")
    assert list(info.value.failures) == [1]
    cause = info.value.failures[1]
    assert isinstance(cause, ReadError), repr(cause)
    assert "Input/output error" in str(cause) and llama_copy in str(cause)
    assert names_a_tensor(str(cause), {t.name for t in rp.tensors}), str(cause)
    assert_no_leaks(before, "a read error in one rank")


@pytest.mark.ray
def test_failed_reload_leaves_the_actor_without_shards(llama_copy, ray_local):
    """An actor that loaded once and then fails a load holds nothing: shards() raises, never stale or partial."""
    import ray

    plan, rp, fi = plan_and_file(llama_copy, tp=2, rank=0)
    cls = ray.remote(faulty_loader())
    actor = cls.options(num_cpus=1, max_concurrency=4).remote(0, "cpu")
    try:
        opts = ReaderOptions()
        ray.get(actor.load.remote(rp, opts), timeout=120)
        check_rank(rp, ray.get(actor.shards.remote(), timeout=60), llama_copy)
        for fault in ("eio", "truncate"):
            ray.get(actor.arm.remote(fault, 3))
            with pytest.raises(ReadError):
                ray.get(actor.load.remote(rp, opts), timeout=120)
            with pytest.raises(NoShardsError, match="holds no shards"):
                ray.get(actor.shards.remote(), timeout=60)
        # the truncation changed the file: a new load is refused before reading
        ray.get(actor.arm.remote(None))
        with pytest.raises(FileChangedError):
            ray.get(actor.load.remote(rp, opts), timeout=120)
        with pytest.raises(NoShardsError, match="holds no shards"):
            ray.get(actor.shards.remote(), timeout=60)
    finally:
        ray.kill(actor)


