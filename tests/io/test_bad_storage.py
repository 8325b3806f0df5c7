"""Bad network storage, on the emulated mount's faults (`NetFS.control(fault=...)`): a mount that stops answering
fails the read within the storage timeout with one StorageStallError naming the file and the storage kind, nothing
returned, and once the mount answers again or is aborted no raylazy thread or mapping is left; a mount that comes
back with the stalled reads still blocked (`recover`) serves the next load in the process, whose shards those reads,
answered at last, never write into; reads that come short are completed; an error mid-load names the file and the
storage kind."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

import pytest
import torch

import raylazy
from raylazy.core.options import ReaderOptions, serving_options
from raylazy.core.schedule import node_schedule
from raylazy.errors import BuffersInUseError, FileChangedError, RankFailedError, ReadError, StorageStallError
from raylazy.io.backends import read_rank
from raylazy.io.nodes import node_read, node_reads
from raylazy.storage import open_checkpoint
from tests.support.checkpoints import reference_tensors, shard_files
from tests.support.expected import expected_rank, model_config
from tests.support.lazy import load_lazily
from tests.support.raytest import check_loaded, wait_for

TIMEOUT_S = 1.0


def leftovers(mountpoint: str) -> list[str]:
    """raylazy's threads alive in this process, and its mappings of files under `mountpoint`. Not counted: the pool
    object storage keeps for the process (`raylazy-part`, started by an object storage test run earlier in this
    process; files are never read through it)."""
    with open("/proc/self/maps") as f:
        maps = [line.split()[-1] for line in f if mountpoint in line]
    return [t.name for t in threading.enumerate() if t.name.startswith("raylazy") and
            not t.name.startswith("raylazy-part")] + maps


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


#: The fault matrix (docs/reliability.md): each read path in each mode of the emulated mount it runs in ("cached":
#: pages kept, NFS-like; "direct": direct_io, a bucket mount), and each fault, with the error it ends in (None:
#: exact shards). Cooperative reads on the cached mount read their keeps out of the page cache; on the direct one
#: (no page cache to share) they fetch the node's stripes into stages in shared memory.
PATHS = [("cached", "ranged"), ("direct", "ranged"), ("cached", "cooperative"), ("direct", "cooperative"),
         ("cached", "fastsafetensors"), ("direct", "fastsafetensors"), ("cached", "vllm"), ("direct", "vllm")]
FAULTS = {"stall": StorageStallError, "eio": ReadError, "short": None, "truncate": (FileChangedError, ReadError),
          "replace": FileChangedError}


def outcome(path: str, fault: str):
    """The error class (or classes) a fault ends in on `path`; None: exact shards. fastsafetensors does not read
    on after a read answered short: a ReadError."""
    return ReadError if (path, fault) == ("fastsafetensors", "short") else FAULTS[fault]


def cells():
    """(mode, path, fault): every path in its modes, every fault; reads answered short only with direct_io, where
    they reach the reader (a cached mount's kernel takes a short answer for the file's end: FUSE's protocol, and an
    NFS client completes short reads itself)."""
    return [(m, p, f) for m, p in PATHS for f in FAULTS if m == "direct" or f != "short"]


def read_path(path: str, model: str):
    """Everything `path` reads of `model` (a mount's directory) on one rank, in this process: raylazy.load's rank
    read with that backend (planned, each rank's backend chosen by the node-read driver), or the vLLM format's
    recorded run of a consumer copying every weight whole, replayed over the regions served. Planned now; returns
    the read, which returns {name: tensor}."""
    if path == "vllm":
        ckpt = open_checkpoint(model)
        params = {}

        def consume(weights):
            for name, w in weights:
                params.setdefault(name, torch.empty(w.shape, dtype=w.dtype)).copy_(w)

        def load() -> dict:
            load_lazily(ckpt, consume, serving_options({"request_timeout_s": TIMEOUT_S}), watch=lambda: params)
            return params

        return load
    reader = ReaderOptions(backend=path, request_timeout_s=TIMEOUT_S)
    plan, (rank,) = node_reads(raylazy.plan(model, tp=1), ["node"], ["cpu"], reader, f"m{time.monotonic_ns()}",
                               meet=lambda ranks: pytest.fail("one rank: no node exchanges"))
    return lambda: read_rank(plan.ranks[0], "cpu", options=rank.reader, node_read=rank.node_read)[0]


def replace_file(path: str) -> None:
    """A file replaced after planning by one of the same size, its header (a tensor renamed) and data differing."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[data.index(b'"model.') + 1] = ord("n")
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = bytes(b ^ 0xFF for b in data[start:])
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.replace(path + ".new", path)


@pytest.mark.parametrize("mode,path,fault", cells())
def test_every_fault_on_every_path_ends_in_a_named_error_or_exact_shards(netfs, llama_dir, llama_copy, mode, path,
                                                                        fault):
    """The fault matrix: a stall, EIO mid-load, reads answered short, a file truncated or replaced after planning
    (truncated: a FileChangedError where the open sees it, else a ReadError for the file ending early). Each ends in
    its named error within request_timeout_s + 2 s, naming the file (or in exact shards); no process
    is killed (an EIO met through a mapping would be a SIGBUS: this process); once the storage answers or the file
    is back, the next load in the process, planned again, is exact; and no raylazy thread or mapping of the mount
    is left."""
    fs = netfs(llama_copy, mode=mode, latency_s=0.001, attr_timeout_s=0.0)  # a change behind it seen at once
    largest = max(shard_files(llama_copy), key=lambda n: os.path.getsize(os.path.join(llama_copy, n)))
    read = read_path(path, fs.mountpoint)
    fs.reset()
    half = raylazy.plan(fs.mountpoint, tp=1).bytes_needed // 2
    fs.reset()
    if fault == "truncate":
        os.truncate(os.path.join(llama_copy, largest), os.path.getsize(os.path.join(llama_copy, largest)) - 4096)
    elif fault == "replace":
        replace_file(os.path.join(llama_copy, largest))
    else:
        fs.control(fault={"stall": {"stall": True}, "eio": {"fail": 5}, "short": {"short": True}}[fault]
                   | {"after_bytes": half})
    t0 = time.monotonic()
    try:
        if outcome(path, fault) is None:
            assert exact(read(), llama_dir), "reads answered short: the shards are not exact"
        else:
            with pytest.raises(outcome(path, fault)) as err:
                read()
            waited = time.monotonic() - t0
            assert waited < TIMEOUT_S + 2, waited
            assert fs.mountpoint in str(err.value), err.value
            if fault == "eio":
                assert not isinstance(err.value, StorageStallError) and "on fuse storage" in str(err.value), err.value
    finally:
        fs.control(fault=None)  # the stalled reads answered
        shutil.copyfile(os.path.join(llama_dir, largest), os.path.join(llama_copy, largest))
    assert exact(read_path(path, fs.mountpoint)(), llama_dir), "the next load is not exact"
    assert not gone_within(fs.mountpoint, 5.0)


def test_planning_on_a_stalled_mount_fails_within_the_storage_timeout(netfs, llama_dir):
    """Planning's header reads are requests like the readers': a mount that stops answering fails `raylazy.plan`
    with a StorageStallError naming the file within request_timeout_s (+ 2 s), and once it answers, the blocked
    read's thread ends and planning works."""
    fs = netfs(llama_dir, mode="cached", latency_s=0.001)
    fs.control(fault={"stall": True})
    stalled(fs, lambda: raylazy.plan(fs.mountpoint, tp=2, request_timeout_s=TIMEOUT_S))
    fs.control(fault=None)
    assert not gone_within(fs.mountpoint, 5.0)
    assert raylazy.plan(fs.mountpoint, tp=2).bytes_needed == raylazy.plan(llama_dir, tp=2).bytes_needed


@pytest.mark.ray
def test_a_load_from_a_stalled_mount_fails_as_one_error(netfs, llama_dir, ray_local):
    """raylazy.load tp=2 from a mount that stalls mid-load: one RankFailedError, each rank's cause a
    StorageStallError, within the storage timeout (not the load's); the load returns nothing."""
    fs = netfs(llama_dir, mode="direct", latency_s=0.001)
    raylazy.plan(fs.mountpoint, tp=2)  # the mount probed, once for the process (`raylazy.storage.probe`)
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
@pytest.mark.parametrize("backend", ["ranged", "exchange", "cooperative"])
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
        raylazy.plan(fs.mountpoint, tp=2)  # the mount probed, once for the process
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
