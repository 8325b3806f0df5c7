"""Bad network storage, on the emulated mount's faults (`NetFS.control(fault=...)`): a mount that stops answering
fails the read within the storage timeout with one StorageStallError naming the file and the storage kind, nothing
returned, and once the mount answers again or is aborted no raylazy thread or mapping is left; a mount that comes
back with the stalled reads still blocked (`recover`) serves the next load in the process, whose shards those reads,
answered at last, never write into; reads that come short are completed; an error mid-load names the file and the
storage kind."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

import raylazy
from raylazy.core.options import ReaderOptions
from raylazy.core.schedule import node_schedule
from raylazy.errors import BuffersInUseError, RankFailedError, ReadError, StorageStallError
from raylazy.io.backends import read_rank
from raylazy.io.nodes import node_read
from tests.support.checkpoints import reference_tensors, shard_files
from tests.support.expected import expected_rank, model_config
from tests.support.raytest import check_loaded, wait_for

TIMEOUT_S = 1.0


def leftovers(mountpoint: str) -> list[str]:
    """raylazy's threads alive in this process, and its mappings of files under `mountpoint`."""
    with open("/proc/self/maps") as f:
        maps = [line.split()[-1] for line in f if mountpoint in line]
    return [t.name for t in threading.enumerate() if t.name.startswith("raylazy")] + maps


def gone_within(mountpoint: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while (left := leftovers(mountpoint)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def half_way(fs, plan) -> int:
    """Bytes served once the ranks' header checks and about half their data have been (the fault's start)."""
    return plan.bytes_needed // 2


def abort_connection(fs) -> None:
    """`NetFS.abort`, skipped (a failure where RAYLAZY_REQUIRE_FUSE=1, .ci/run) where fusectl is not mounted."""
    try:
        fs.abort()
    except RuntimeError as e:
        fs.control(fault=None)
        if os.environ.get("RAYLAZY_REQUIRE_FUSE") == "1":
            pytest.fail(f"RAYLAZY_REQUIRE_FUSE=1 but the mount cannot be aborted here: {e}")
        pytest.skip(f"cannot abort a FUSE mount here: {e}")


def read_one_rank(plan, backend: str, out=None):
    options = ReaderOptions(backend=backend, request_timeout_s=TIMEOUT_S)
    task = node_read(backend, plan, node_schedule(plan, [0]), f"stall{time.monotonic_ns()}") \
        if backend == "cooperative" else None
    return read_rank(plan.ranks[0], "cpu", options=options, node_read=task, out=out)


def stalled(fs, read) -> None:
    """`read()` fails with a StorageStallError within the timeout (and 2 s for a busy machine)."""
    t0 = time.monotonic()
    with pytest.raises(StorageStallError):
        read()
    assert time.monotonic() - t0 < TIMEOUT_S + 2


def exact(shards: dict, model_dir: str, rank: int = 0, tp: int = 1) -> bool:
    want = expected_rank(reference_tensors(model_dir), model_config(model_dir), rank, tp)
    return shards.keys() == want.keys() and all(torch.equal(shards[n], t) for n, t in want.items())


def rewrite(model_dir: str) -> None:
    """Every data byte of the checkpoint's files inverted, in place (the inodes the mount's server holds open): the
    reads a recovered mount still held then bring bytes no shard of the original has."""
    for name in shard_files(model_dir):
        with open(os.path.join(model_dir, name), "r+b") as f:
            f.seek(8 + int.from_bytes(f.read(8), "little"))
            data = bytes(b ^ 0xFF for b in f.read())
            f.seek(-len(data), os.SEEK_END)
            f.write(data)


@pytest.mark.parametrize("mode,backend,recover", [("direct", "ranged", "answer"), ("direct", "ranged", "abort"),
                                                   ("cached", "cooperative", "answer")])
def test_a_stalled_mount_fails_the_read_and_leaves_nothing_behind(netfs, llama_dir, mode, backend, recover):
    fs = netfs(llama_dir, mode=mode, latency_s=0.001)
    plan = raylazy.plan(fs.mountpoint, tp=1)
    fs.reset()
    fs.control(fault={"stall": True, "after_bytes": half_way(fs, plan)})
    t0 = time.monotonic()
    with pytest.raises(StorageStallError) as err:
        read_one_rank(plan, backend)
    waited = time.monotonic() - t0
    assert TIMEOUT_S <= waited < TIMEOUT_S + 2, waited
    message = str(err.value)
    assert fs.mountpoint in message and "fuse (fuse.raylazy-netfs" in message and "request_timeout_s=1" in message
    assert leftovers(fs.mountpoint), "a read blocked on the stalled mount should still be waiting"
    if recover == "answer":
        fs.control(fault=None)
    else:
        abort_connection(fs)
    assert not gone_within(fs.mountpoint, 5.0)


def test_reads_that_come_short_are_completed(netfs, llama_dir):
    """With direct_io every read the server answers short reaches the reader short: it reads on for the rest."""
    fs = netfs(llama_dir, mode="direct", latency_s=0.0)
    plan = raylazy.plan(fs.mountpoint, tp=2)
    fs.control(fault={"short": True})
    full, cfg = reference_tensors(llama_dir), model_config(llama_dir)
    shards, _ = read_rank(plan.ranks[1], "cpu", options=ReaderOptions(backend="ranged"))
    want = expected_rank(full, cfg, 1, 2)
    assert shards.keys() == want.keys() and all(torch.equal(shards[n], t) for n, t in want.items())


def test_an_error_mid_load_names_the_file_and_the_storage_kind(netfs, llama_dir):
    fs = netfs(llama_dir, mode="direct", latency_s=0.0)
    plan = raylazy.plan(fs.mountpoint, tp=1)
    fs.reset()
    fs.control(fault={"fail": 5, "after_bytes": half_way(fs, plan)})  # EIO
    with pytest.raises(ReadError) as err:
        read_one_rank(plan, "ranged")
    assert not isinstance(err.value, StorageStallError)
    assert fs.mountpoint in str(err.value) and "on fuse storage" in str(err.value), err.value
    assert not gone_within(fs.mountpoint, 5.0)


@pytest.mark.ray
def test_a_load_from_a_stalled_mount_fails_as_one_error(netfs, llama_dir, ray_local):
    """raylazy.load tp=2 from a mount that stalls mid-load: one RankFailedError, each rank's cause a
    StorageStallError, within the storage timeout (not the load's); the load returns nothing."""
    fs = netfs(llama_dir, mode="direct", latency_s=0.001)
    fs.reset()
    raylazy.plan(fs.mountpoint, tp=2)
    planning = fs.stats()["bytes"]  # what the load's own planning reads again, before its ranks read
    fs.reset()
    # every read past the planning's stalls (the ranks' first, their header checks, included): a threshold inside
    # the data would race the few requests this tiny checkpoint needs, all in flight before the count reaches it
    fs.control(fault={"stall": True, "after_bytes": planning})
    try:
        with pytest.raises(RankFailedError) as err:
            raylazy.load(fs.mountpoint, 2, device="cpu", progress=False, request_timeout_s=TIMEOUT_S, timeout_s=120)
        failed_at = time.monotonic()
    finally:
        fs.control(fault=None)
    stalled_at = fs.stats()["stalled_at"]  # read once the stalled reads are answered: none holds a server thread
    # timed from the first stalled read, not from the call (which also starts fresh actors: slow on a busy machine)
    assert stalled_at is not None and failed_at - stalled_at < 30, (stalled_at, failed_at)
    assert err.value.failures and all(isinstance(c, StorageStallError) for c in err.value.failures.values()), err.value


def test_the_next_load_after_a_stall_reads_exact_shards_that_the_stalled_reads_never_touch(netfs, llama_dir,
                                                                                          llama_copy):
    """A mount that stalls, then comes back with the stalled reads still blocked, as a network server does: the next
    load in the process is not failed by them, and once they are answered (with other bytes: the files were
    rewritten meanwhile) its shards are still exact. Uncached (direct_io): on a cached mount the pages those reads
    fill stay locked in the kernel until answered, and a later load that needs them waits on them too."""
    fs = netfs(llama_copy, mode="direct", latency_s=0.001)
    plan = raylazy.plan(fs.mountpoint, tp=1)
    fs.reset()
    fs.control(fault={"stall": True, "after_bytes": half_way(fs, plan)})
    stalled(fs, lambda: read_one_rank(plan, "ranged"))
    fs.control(recover=True)
    shards, _ = read_one_rank(plan, "ranged")
    assert exact(shards, llama_dir)
    assert leftovers(fs.mountpoint), "the stalled load's reads should still be blocked"
    rewrite(llama_copy)
    fs.control(release=True)
    assert not gone_within(fs.mountpoint, 5.0)
    assert exact(shards, llama_dir)


def test_shards_a_stalled_reload_still_fills_are_refused_until_its_reads_return(netfs, llama_dir, llama_copy):
    """A reload into held shards (`out`) that stalls: the reads it left blocked write into those shards when answered,
    so another reload into them is a BuffersInUseError until then, and reads exact shards after."""
    fs = netfs(llama_copy, mode="direct", latency_s=0.001)
    plan = raylazy.plan(fs.mountpoint, tp=1)
    held, _ = read_one_rank(plan, "ranged")
    fs.reset()
    fs.control(fault={"stall": True, "after_bytes": half_way(fs, plan)})
    stalled(fs, lambda: read_one_rank(plan, "ranged", out=held))
    fs.control(recover=True)
    with pytest.raises(BuffersInUseError, match=f"{fs.mountpoint}.*given up .*a load, not a reload"):
        read_one_rank(plan, "ranged", out=held)
    fs.control(release=True)
    assert not gone_within(fs.mountpoint, 5.0)
    got, _ = read_one_rank(plan, "ranged", out=held)
    assert exact(got, llama_dir) and all(got[n] is t for n, t in held.items())


def reading_threads(rank: int, shards: dict) -> list[str]:
    """Run in a rank (`loaded.run`): the names of its threads reading for a load."""
    return [t.name for t in threading.enumerate() if t.name.startswith(("raylazy-rank-read", "raylazy-read",
                                                                        "raylazy-stripe"))]


@pytest.mark.ray
@pytest.mark.parametrize("backend", ["ranged", "exchange"])
def test_the_same_actors_load_again_once_a_stalled_mount_answers(netfs, llama_dir, llama_copy, ray_local, backend):
    """raylazy.load tp=2 into the caller's actors from a mount that stalls: a RankFailedError of StorageStallErrors;
    once the mount answers new reads (the stalled ones still blocked) a load into the same actors reads exact
    shards, still exact once the stalled reads are answered with other bytes."""
    import ray

    from raylazy.cluster.actor import RankLoader

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # `reading_threads` travels to the ranks
    fs = netfs(llama_copy, mode="direct", latency_s=0.001)
    actors = [ray.remote(num_cpus=0.5, max_concurrency=4)(RankLoader).remote(r, "cpu") for r in range(2)]
    options = dict(device="cpu", progress=False, backend=backend, request_timeout_s=TIMEOUT_S, timeout_s=120,
                   actors=actors)
    try:
        fs.reset()
        raylazy.plan(fs.mountpoint, tp=2)
        planning = fs.stats()["bytes"]
        fs.reset()
        fs.control(fault={"stall": True, "after_bytes": planning})  # past the load's planning (the test above)
        with pytest.raises(RankFailedError) as err:
            raylazy.load(fs.mountpoint, 2, **options)
        assert all(isinstance(c, StorageStallError) for c in err.value.failures.values()), err.value
        fs.control(recover=True)
        loaded = raylazy.load(fs.mountpoint, 2, **options)
        check_loaded(loaded, llama_dir)
        rewrite(llama_copy)
        fs.control(release=True)
        wait_for(lambda: not any(ray.get(loaded.run(reading_threads), timeout=60)), 30, "the stalled reads to end")
        check_loaded(loaded, llama_dir)
    finally:
        for a in actors:
            ray.kill(a)
