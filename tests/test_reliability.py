"""What raylazy does under faults: a rank's process killed, a node lost, checkpoint files changing
or failing under the reader, memory bounds, concurrent loads, and an interrupted driver.

Each fault is injected deterministically:

* A rank is made to block part-way through its read on the first attempt only
  (`blocking_loader`: a test rank actor, loaded with `raytest.load_with`, that patches the
  ranged reader in its own process and leaves a marker file with its pid and node), so the
  driver knows exactly when to kill its process, remove its node or interrupt itself.
* Reader faults patch `os.preadv` / `os.open` (in the test process for direct
  `read_rank` calls, inside the actor for loads): tests run as root, so permissions
  cannot be taken away with chmod.

Costs: every actor start imports torch (seconds on a small machine). The tests use the
session's local Ray (`ray_local`, 8 logical CPUs) and tp 2 where they can; the node-loss
tests run in a child Python on a `ray.cluster_utils.Cluster` of their own (a GPU-less head
and three worker nodes with logical GPUs), started once for both.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import gc
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time

import pytest
import torch
from planlib import as_bytes  # noqa: E402  (tests/ is on sys.path)
from raytest import (
    assert_no_leaks,
    check_loaded,
    check_rank,
    live,
    load_with,
    raylazy_actors,
    raylazy_groups,
    start_cluster,
    stop_cluster,
    wait_for,
    where_am_i,
)

import raylazy
from raylazy.cluster.actor import RankLoader
from raylazy.core.options import ReaderOptions
from raylazy.errors import FileChangedError, NoShardsError, RankFailedError, ReadError
from raylazy.io.ranged import read_rank_ranged

try:  # actor classes and functions defined here travel by value: workers need not import this file
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except Exception:  # noqa: BLE001  (Ray missing: the Ray tests skip)
    pass


# --- helpers ---------------------------------------------------------------------------------------


def blocking_loader(marker_dir: str, victims, block_s: float = 300.0, release_file: str | None = None) -> type:
    """A RankLoader class whose ranks in `victims` block part-way through their first read.

    On the first attempt (no marker file yet for the rank) the rank reads one window,
    writes `<marker_dir>/rank<r>` (pid, node id, bytes loaded) and blocks for `block_s`
    seconds or until `release_file` exists, with the rest of its shards not yet read. A
    restarted actor finds its marker and reads normally.
    """

    class BlockingLoader(RankLoader):
        def load(self, plan, options, node_read=None):
            rank = self.info().rank
            marker = os.path.join(marker_dir, f"rank{rank}")
            if rank not in victims or os.path.exists(marker):
                return super().load(plan, options, node_read)
            import raylazy.io.ranged as ranged

            real, blocked = ranged._Reader.run, threading.Lock()
            me = self

            def run(reader, job, buf):
                real(reader, job, buf)
                if blocked.acquire(blocking=False):  # the first window to finish: block here
                    import ray

                    info = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                            "progress": me.progress()}
                    with open(marker + ".tmp", "w") as f:
                        json.dump(info, f)
                    os.replace(marker + ".tmp", marker)
                    deadline = time.monotonic() + block_s
                    while time.monotonic() < deadline and not (release_file and os.path.exists(release_file)):
                        time.sleep(0.05)

            ranged._Reader.run = run
            try:
                return super().load(plan, options, node_read)
            finally:
                ranged._Reader.run = real

    return BlockingLoader


def read_marker(marker_dir: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(marker_dir, f"rank{rank}")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def when(predicate, action, stop: threading.Event, timeout_s: float = 180) -> threading.Thread:
    """A started daemon thread that calls action(value) on predicate()'s first truthy value (polled
    every 50 ms), unless `stop` is set or `timeout_s` passes first."""

    def go():
        deadline = time.monotonic() + timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            value = predicate()
            if value:
                if not stop.is_set():
                    action(value)
                return
            time.sleep(0.05)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


#: What `preadv_fault` can do to a call.
PREADV_FAULTS = ("eio", "truncate")


@contextlib.contextmanager
def preadv_fault(kind: str | None, after: int = 0):
    """Patch os.preadv (process-wide) so that its `after`-th call fails.

    kind "eio": the call raises OSError(EIO). kind "truncate": the file being read is
    truncated to its first 8 bytes just before the call (as if replaced under the reader).
    kind None: no call fails, the calls are only counted. Yields a dict whose "calls"
    counts the calls so far and whose "fired" is the path of the failed call's file.
    """
    if kind is not None and (kind not in PREADV_FAULTS or after < 1):
        raise ValueError(f"preadv_fault({kind!r}, after={after}): kind is one of {PREADV_FAULTS} or None, after >= 1")
    real, lock, state = os.preadv, threading.Lock(), {"calls": 0, "fired": None}

    def preadv(fd, buffers, offset, *args):
        with lock:
            state["calls"] += 1
            fire = kind is not None and state["calls"] == after
        if fire:
            path = os.readlink(f"/proc/self/fd/{fd}")
            state["fired"] = path
            if kind == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            os.truncate(path, 8)
        return real(fd, buffers, offset, *args)

    os.preadv = preadv
    try:
        yield state
    finally:
        os.preadv = real


def faulty_loader(fail_rank: int | None = None, kind: str | None = None, after: int = 0) -> type:
    """A RankLoader whose rank `fail_rank` loads under `preadv_fault(kind, after)` until re-armed;
    the other ranks (all of them by default) load without a fault."""

    class FaultyLoader(RankLoader):
        def __init__(self, rank: int, device: str = "auto"):
            super().__init__(rank, device)
            self._fault = (kind, after) if rank == fail_rank else (None, 0)

        def arm(self, fault_kind: str | None, fault_after: int = 0) -> None:
            self._fault = (fault_kind, fault_after)

        def load(self, plan, options, node_read=None):
            with preadv_fault(*self._fault):
                return super().load(plan, options, node_read)

    return FaultyLoader


@pytest.fixture
def llama_copy(llama_dir, tmp_path) -> str:
    """A private copy of the llama checkpoint, free to break."""
    return str(shutil.copytree(llama_dir, tmp_path / "llama"))


def _plan_and_file(model_dir: str, tp: int = 2, rank: int = 0):
    """The plan, rank `rank`'s RankPlan, and the index of the file it reads most tensors from."""
    plan = raylazy.plan(model_dir, tp)
    rp = plan.ranks[rank]
    counts: dict[int, int] = {}
    for t in rp.tensors:
        for r in t.reads:
            counts[r.file] = counts.get(r.file, 0) + 1
    return plan, rp, max(counts, key=counts.get)


def _tensors_of(rp, file_index: int) -> set[str]:
    return {t.name for t in rp.tensors if any(r.file == file_index for r in t.reads)}


def _names_a_tensor(message: str, names: set[str]) -> bool:
    return any(repr(n) in message for n in names)


# --- 3. files that change or fail under the reader (no Ray: read_rank_ranged directly) ---------------------


@pytest.mark.parametrize("change", ["truncated", "grown", "same_size_other_header", "deleted", "fifo"])
def test_file_changed_after_planning(llama_copy, change):
    plan, rp, fi = _plan_and_file(llama_copy)
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
    assert _names_a_tensor(str(err), _tensors_of(rp, fi)), f"no tensor named in: {err}"


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("kind", ["eio", "truncate"])
def test_file_fails_during_reading(llama_copy, kind, stage):
    """EIO or a truncation half-way through the reads: ReadError naming the file and a tensor, no result."""
    plan, rp, fi = _plan_and_file(llama_copy)
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
    assert _names_a_tensor(err, names), err
    assert ("Input/output error" in err) if kind == "eio" else ("truncated" in err)


def test_open_fails_with_permission_denied(llama_copy, monkeypatch):
    """Tests run as root, so EACCES is simulated: os.open of one planned file raises PermissionError."""
    plan, rp, fi = _plan_and_file(llama_copy)
    path, real_open = rp.files[fi].uri, os.open

    def fake_open(p, flags, *args, **kwargs):
        if os.fspath(p) == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), p)
        return real_open(p, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    with pytest.raises(ReadError) as info:
        read_rank_ranged(rp, "cpu")
    assert path in str(info.value) and "Permission denied" in str(info.value)
    assert _names_a_tensor(str(info.value), _tensors_of(rp, fi)), str(info.value)


def test_file_replaced_by_rename_while_reading_keeps_the_planned_bytes(llama_copy, llama_dir):
    """Promise: an open file is read to the end even if a new file is renamed over its path
    (the reader holds the planned inode); the shards are those of the planned file."""
    plan, rp, fi = _plan_and_file(llama_copy)
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


# --- 1. a rank's process killed mid-load ------------------------------------------------------------


def _kill_when_blocked(marker_dir: str, rank: int, out: dict, stop: threading.Event) -> threading.Thread:
    """Once rank `rank` blocks mid-read (its marker exists), SIGKILL its process; `out` gets the marker."""

    def kill(info: dict) -> None:
        out.update(info, killed_at=time.monotonic())
        os.kill(info["pid"], signal.SIGKILL)

    return when(lambda: read_marker(marker_dir, rank), kill, stop)


@pytest.mark.ray
def test_rank_killed_mid_load_is_restarted_and_reloads(llama_dir, ray_local, tmp_path):
    import ray

    victim, killed, stop = 1, {}, threading.Event()
    before = live()
    killer = _kill_when_blocked(str(tmp_path), victim, killed, stop)
    try:
        loaded = load_with(blocking_loader(str(tmp_path), {victim}), llama_dir, 2, device="cpu", progress=False, backend="ranged",
                           timeout_s=180)
    finally:
        stop.set()
        killer.join()
    try:
        assert killed.get("pid"), "the victim never blocked mid-load"
        assert 0 < killed["progress"] < loaded.plan.ranks[victim].stats.bytes_needed
        check_loaded(loaded, llama_dir)
        inside = ray.get(loaded.run(where_am_i), timeout=60)
        assert inside[victim]["pid"] != killed["pid"], "the victim's shards should come from its restarted process"
        # After the load, a second death: Ray restarts the actor, which reads its plan again by itself
        # (alone, from Ray's KV), and loaded.ranks shows the new process.
        os.kill(inside[victim]["pid"], signal.SIGKILL)
        wait_for(lambda: loaded.ranks[victim].pid != inside[victim]["pid"], 60, "the restart")
        again = ray.get(loaded.run(where_am_i), timeout=60)
        assert again[victim]["pid"] == loaded.ranks[victim].pid != inside[victim]["pid"]
        assert [r["digest"] for r in again] == [r["digest"] for r in inside]
        check_loaded(loaded, llama_dir)
    finally:
        loaded.release()
    assert_no_leaks(before, "release after a restarted rank")


@pytest.mark.ray
def test_rank_killed_without_retries_fails_fast_and_releases(llama_dir, ray_local, tmp_path):
    victim, killed, stop = 0, {}, threading.Event()
    before = live()
    killer = _kill_when_blocked(str(tmp_path), victim, killed, stop)
    timeout_s = 120
    t0 = time.monotonic()
    try:
        with pytest.raises(RankFailedError) as info:
            load_with(blocking_loader(str(tmp_path), {victim}), llama_dir, 2, device="cpu", progress=False, backend="ranged",
                      max_retries=0, timeout_s=timeout_s)
    finally:
        stop.set()
        killer.join()
    done = time.monotonic()
    assert killed.get("pid"), "the victim never blocked mid-load"
    assert list(info.value.failures) == [victim]
    assert f"rank {victim}: " in str(info.value)
    assert done - t0 < timeout_s
    assert done - killed["killed_at"] < 30, "a dead rank must be reported promptly, not at the timeout"
    assert_no_leaks(before, "a rank killed without retries")


# --- 3 (Ray). reader failures inside the actors -------------------------------------------------------


@pytest.mark.ray
def test_read_error_in_a_rank_fails_the_load_and_releases(llama_copy, ray_local):
    plan, rp, fi = _plan_and_file(llama_copy, rank=1)
    before = live()
    with pytest.raises(RankFailedError) as info:
        load_with(faulty_loader(1, "eio", 3), llama_copy, 2, device="cpu", progress=False, backend="ranged")
    assert list(info.value.failures) == [1]
    cause = info.value.failures[1]
    assert isinstance(cause, ReadError), repr(cause)
    assert "Input/output error" in str(cause) and llama_copy in str(cause)
    assert _names_a_tensor(str(cause), {t.name for t in rp.tensors}), str(cause)
    assert_no_leaks(before, "a read error in one rank")


@pytest.mark.ray
def test_failed_reload_leaves_the_actor_without_shards(llama_copy, ray_local):
    """An actor that loaded once and then fails a load holds nothing: shards() raises, never stale or partial."""
    import ray

    plan, rp, fi = _plan_and_file(llama_copy, tp=2, rank=0)
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


# --- 5. memory: a rank's peak RSS ------------------------------------------------------------------

#: Process growth besides shards and staging a rank may show while loading (allocator, threads, plan).
#: Measured: 3 MB (in place) and 1 MB (staged) at tp=4 on the 530 MB checkpoint.
RSS_SLACK = 16 << 20


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measured(fn):
    """(fn(), baseline RSS, peak RSS during fn) of this process: VmHWM reset via clear_refs, plus sampling."""
    gc.collect()
    base = _status_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        hwm = True
    except OSError:
        hwm = False
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _status_kb("VmRSS"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        stop.set()
        sampler.join()
    peak = max(peak[0], _status_kb("VmRSS"), _status_kb("VmHWM") if hwm else 0)
    return result, base, peak


class MemoryLoader(RankLoader):
    """Records the baseline and peak RSS of its process around each load."""

    def load(self, plan, options, node_read=None):
        self._shards = None
        stats, base, peak = _measured(lambda: super(MemoryLoader, self).load(plan, options, node_read))
        self._memory = {"base": base, "peak": peak, "staging": stats.staging_bytes,
                        "shard_bytes": sum(t.nbytes for t in plan.tensors)}
        return stats

    def memory(self) -> dict:
        return self._memory


def staged_read_memory(rank: int, shards: dict, plan_rank, options) -> dict:
    """Run in a rank actor: read the plan again through the staging pipeline, measuring RSS."""
    (again, stats), base, peak = _measured(lambda: read_rank_ranged(plan_rank, "cpu", options=options, stage=True))
    same = all(torch.equal(again[n].view(torch.uint8), shards[n].view(torch.uint8)) for n in shards)
    del again
    return {"base": base, "peak": peak, "staging": stats.staging_bytes, "same": same,
            "shard_bytes": sum(t.nbytes for t in plan_rank.tensors)}


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory) -> str:
    """A ~530 MB Llama-shaped bf16 checkpoint: the embedding and lm_head are 131 MB each."""
    from raylazy.synthetic import LlamaShape, write_llama_checkpoint

    shape = LlamaShape(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, intermediate_size=5632,
                       num_hidden_layers=3, vocab_size=32000)
    return write_llama_checkpoint(str(tmp_path_factory.mktemp("big") / "llama"), shape, num_files=4)


@pytest.mark.ray
def test_rank_peak_rss_stays_within_shards_plus_staging(big_llama, ray_local):
    import ray

    tp = 4
    before = live()
    loaded = load_with(MemoryLoader, big_llama, tp, device="cpu", progress=False, backend="ranged", timeout_s=300)
    try:
        chunk = 8 << 20
        staged_opts = ReaderOptions(chunk_bytes=chunk, queue_size=1)
        runs = [a.run.remote(staged_read_memory, loaded.plan.ranks[r], staged_opts)
                for r, a in enumerate(loaded.actors)]
        memory = ray.get([a.memory.remote() for a in loaded.actors], timeout=60)
        staged = ray.get(runs, timeout=300)
        for r, rp in enumerate(loaded.plan.ranks):
            # the bound is discriminating: reading any split tensor whole would exceed the slack
            excess = max(t.nbytes * (t.full_shape[t.dim] / t.shape[t.dim] - 1) for t in rp.tensors if t.dim is not None)
            assert excess > RSS_SLACK, (r, excess)
            m = memory[r]
            assert m["staging"] == 0  # CPU shards are read in place
            grown = m["peak"] - m["base"]
            assert m["shard_bytes"] <= grown + RSS_SLACK, (r, m)  # sanity: the shards were really touched
            assert grown <= m["shard_bytes"] + m["staging"] + RSS_SLACK, (
                f"rank {r}: RSS grew {grown >> 20} MB loading {m['shard_bytes'] >> 20} MB of shards")
            s = staged[r]
            assert s["same"] and 0 < s["staging"] <= (staged_opts.queue_size + 2) * chunk
            grown = s["peak"] - s["base"]
            assert grown <= s["shard_bytes"] + s["staging"] + RSS_SLACK, (
                f"rank {r} staged: RSS grew {grown >> 20} MB for {s['shard_bytes'] >> 20} MB of shards "
                f"and {s['staging'] >> 20} MB of staging")
    finally:
        loaded.release()
    assert_no_leaks(before, "the memory test")


# --- 6. concurrent loads -------------------------------------------------------------------------------


@pytest.mark.ray
def test_concurrent_loads_complete_or_wait_and_release_independently(llama_dir, qwen2_dir, ray_local):
    """Three loads at once on 8 CPUs: llama tp=2 (2 CPUs), qwen2 tp=2 (2 CPUs), llama again tp=2 with
    2.5 CPUs a rank (5 CPUs): 9 CPUs asked, so one waits until another is released."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    before = live()
    specs = {"llama": (llama_dir, 1.0), "qwen2": (qwen2_dir, 1.0), "llama-big": (llama_dir, 2.5)}
    assert ray.cluster_resources()["CPU"] < 9
    # placement groups of earlier tests are removed asynchronously: wait for their CPUs to come back
    wait_for(lambda: ray.available_resources().get("CPU", 0) >= 8, 60, "the CPUs of earlier loads")
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {pool.submit(raylazy.load, d, 2, device="cpu", progress=False, cpus_per_rank=cpus,
                           placement_timeout_s=240, timeout_s=240): name for name, (d, cpus) in specs.items()}
    loaded: dict = {}

    def finished():
        done = [f for f in futures if f.done()]
        return done if len(done) >= 2 else None

    try:
        # any two fit (2 + 2 or 2 + 5 CPUs), the three do not: two finish while the third waits, its
        # placement group pending
        done = wait_for(finished, 240, "two of the loads")
        waiting = set(futures) - set(done)
        assert len(waiting) == 1, "with 9 CPUs asked of 8, one load must wait"
        (third,) = waiting
        wait_for(lambda: {g for g, state in raylazy_groups().items() if state == "PENDING"} - before[1], 30,
                 "the third load's placement group to wait for CPUs")
        assert not third.done(), "with 9 CPUs asked of 8, one load must wait"
        for f in done:
            loaded[futures[f]] = f.result()
        first = next(iter(loaded))
        check_loaded(loaded[first], specs[first][0])
        loaded[first].release()  # frees enough for the waiting load
        loaded[futures[third]] = third.result(timeout=240)
        others = [n for n in loaded if n != first]
        for n in others:
            check_loaded(loaded[n], specs[n][0])
        # releasing one does not disturb the other: its actors still hold their shards
        loaded[others[0]].release()
        keep = loaded[others[1]]
        inside = ray.get(keep.run(lambda rank, shards: {k: as_bytes(v) for k, v in shards.items()}), timeout=60)
        for rp, got in zip(keep.plan.ranks, inside):
            check_rank(rp, {t.name: _typed(got[t.name], t) for t in rp.tensors}, specs[others[1]][0])
    finally:
        for f in futures:
            with contextlib.suppress(Exception):
                loaded.setdefault(futures[f], f.result(timeout=300))
        for m in loaded.values():
            m.release()
        pool.shutdown()
    assert_no_leaks(before, "concurrent loads")


def _typed(data: bytes, shard) -> torch.Tensor:
    from raylazy.core.dtypes import torch_dtype

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype(shard.dtype)).reshape(shard.shape)


# --- 7. driver interrupted ------------------------------------------------------------------------------


def _interrupt_when(predicate, stop: threading.Event, fired: dict) -> threading.Thread:
    """Once predicate() holds, raise KeyboardInterrupt in the main thread; fired["at"] says when."""

    def interrupt(_) -> None:
        fired["at"] = time.monotonic()
        _thread.interrupt_main()

    return when(predicate, interrupt, stop)


@pytest.mark.ray
def test_keyboard_interrupt_while_ranks_read_releases_everything(llama_dir, ray_local, tmp_path):
    before, stop, fired = live(), threading.Event(), {}
    t = _interrupt_when(lambda: read_marker(str(tmp_path), 0), stop, fired)
    try:
        with pytest.raises(KeyboardInterrupt):
            load_with(blocking_loader(str(tmp_path), {0}), llama_dir, 2, device="cpu", progress=False, backend="ranged")
    finally:
        stop.set()
        t.join()
    assert fired, "the interrupt never fired"
    assert time.monotonic() - fired["at"] < 30
    assert_no_leaks(before, "KeyboardInterrupt during reading")


@pytest.mark.ray
@pytest.mark.parametrize("phase", ["creating", "placing"])
def test_keyboard_interrupt_while_waiting_for_placement_releases_everything(llama_dir, ray_local, phase):
    """The group can never be placed (100 CPUs a rank). "creating": interrupt as soon as the group
    exists, which lands while the actors are being created; "placing": once both actors exist, in
    the wait for placement."""
    def ready():
        pending = "PENDING" in raylazy_groups().values()
        if phase == "creating" or not pending:
            return pending
        return sum(1 for state in raylazy_actors().values() if state != "DEAD") == 2

    before, stop, fired = live(), threading.Event(), {}
    t = _interrupt_when(ready, stop, fired)
    try:
        with pytest.raises(KeyboardInterrupt):
            raylazy.load(llama_dir, 2, device="cpu", progress=False, cpus_per_rank=100, autoscale=True,
                         placement_timeout_s=300)
    finally:
        stop.set()
        t.join()
    assert fired and time.monotonic() - fired["at"] < 30
    assert_no_leaks(before, "KeyboardInterrupt while waiting for placement")


@pytest.mark.ray
def test_keyboard_interrupt_inside_placement_group_creation_removes_the_group(llama_dir, ray_local, monkeypatch):
    """The narrowest window: the group exists in the GCS but placement_group() has not returned it yet."""
    import importlib

    module = importlib.import_module("ray.util.placement_group")  # the package re-exports a function of that name
    real = module.placement_group

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "placement_group", interrupted)
    before = live()
    with pytest.raises(KeyboardInterrupt):
        raylazy.load(llama_dir, 2, device="cpu", progress=False)
    assert_no_leaks(before, "KeyboardInterrupt inside placement_group()")


# --- 2. node loss (a cluster of its own, in a fresh interpreter) ---------------------------------------
#
# Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported: set later (as the test process
# must, having imported Ray long before), the driver dials the GCS of a loopback-only Cluster at the
# machine's IP and hangs (Ray 2.60, seen with strace). The node-loss scenarios therefore run in a
# child Python with the variable set from the start, and report what they saw as JSON.


def _node_loss_load(cluster, model_dir: str, work: str, tp: int, timeout_s: float) -> dict:
    """Load with every rank blocked mid-read, remove the node of rank 0, let the ranks go on; report."""
    import ray

    marker_dir, release = os.path.join(work, "markers"), os.path.join(work, "go")
    os.makedirs(marker_dir)
    out: dict = {}
    before = live()

    def load():
        try:
            out["loaded"] = load_with(blocking_loader(marker_dir, set(range(tp)), release_file=release), model_dir, tp,
                                      use_gpu=True, device="cpu", progress=False, timeout_s=timeout_s, backend="ranged",
                                      placement_timeout_s=120)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
        out["end"] = time.monotonic()

    t = threading.Thread(target=load, daemon=True)
    t.start()
    markers = wait_for(lambda: [read_marker(marker_dir, r) for r in range(tp)] if all(
        read_marker(marker_dir, r) for r in range(tp)) else None, 240, "every rank to block mid-read")
    lost = markers[0]["node_id"]
    cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == lost))
    removed_at = time.monotonic()
    with open(release, "w"):
        pass
    t.join(timeout_s + 120)
    report = {"tp": tp, "hung": t.is_alive(), "moved": [r for r in range(tp) if markers[r]["node_id"] == lost],
              "after_removal_s": out.get("end", time.monotonic()) - removed_at, "timeout_s": timeout_s}
    err = out.get("error")
    if err is not None:
        report.update(error=type(err).__name__, message=str(err),
                      failures=sorted(getattr(err, "failures", {}) or {}),
                      causes={r: str(e) for r, e in (getattr(err, "failures", {}) or {}).items()})
    loaded = out.get("loaded")
    if loaded is not None:
        try:
            check_loaded(loaded, model_dir)
            report["shards_ok"] = True
            inside = ray.get(loaded.run(where_am_i), timeout=120)
            report["relocated"] = all(inside[r]["node_id"] != lost and inside[r]["pid"] != markers[r]["pid"]
                                      for r in report["moved"])
            table = ray.util.placement_group_table(loaded.placement_group)
            report["bundles_off_lost_node"] = lost not in table["bundles_to_node_id"].values()
        except Exception as e:  # noqa: BLE001
            report["shards_ok"] = f"{type(e).__name__}: {e}"
        finally:
            loaded.release()
    try:
        assert_no_leaks(before, "the node-loss load")
        report["leaks"] = ""
    except AssertionError as e:
        report["leaks"] = str(e)
    return report


#: The no-capacity load's timeout_s, which that scenario waits out. It bounds the load from placement on, so it
#: must hold the actors' start (each imports torch, on two busy cores) and their reads up to the point where they
#: block, with room to spare: the node is removed only once every rank blocks.
NO_CAPACITY_TIMEOUT_S = 30


def node_loss_scenarios(model_dir: str, work: str) -> dict:
    """Run in a fresh interpreter: a GPU-less head and three worker nodes (2 CPUs, 2 logical GPUs each).

    "spare": tp=4 fills two nodes, one of them is lost, the third takes its ranks.
    "no_capacity": then tp = every GPU left (two nodes), one is lost, nowhere to go.
    """
    import ray

    assert os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0", "set it before Ray is imported"
    c = start_cluster(dict(num_cpus=1, num_gpus=0), [dict(num_cpus=2, num_gpus=2)] * 3)
    try:
        ray.init(address=c.address, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
        workers = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]
        assert len(workers) == 3, workers
        results = {"spare": _node_loss_load(c, model_dir, os.path.join(work, "spare"), tp=4, timeout_s=180)}
        gpus = int(sum(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]))
        results["no_capacity"] = _node_loss_load(c, model_dir, os.path.join(work, "full"), tp=gpus,
                                                 timeout_s=NO_CAPACITY_TIMEOUT_S)
        return results
    finally:
        ray.shutdown()
        stop_cluster(c)


@pytest.fixture(scope="module")
def node_loss(llama_dir, tmp_path_factory) -> dict:
    import subprocess

    work = str(tmp_path_factory.mktemp("nodeloss"))
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys, json; sys.path.insert(0, {here!r}); import test_reliability as t; "
            f"print('RESULT ' + json.dumps(t.node_loss_scenarios({llama_dir!r}, {work!r})), flush=True)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=540,
                          cwd=os.path.dirname(here), env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"node-loss run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.ray
def test_node_lost_mid_load_with_spare_capacity_reschedules_its_ranks(node_loss):
    r = node_loss["spare"]
    assert not r["hung"], r
    assert "error" not in r, f"the load should survive a lost node: {r}"
    assert r["moved"] and len(r["moved"]) < r["tp"], r
    assert r["shards_ok"] is True, r
    assert r["relocated"] and r["bundles_off_lost_node"], r
    assert not r["leaks"], r


@pytest.mark.ray
def test_node_lost_mid_load_without_capacity_fails_within_the_timeout(node_loss):
    r = node_loss["no_capacity"]
    assert not r["hung"], r
    assert r.get("error") == "RankFailedError", r
    assert r["failures"] == r["moved"], r  # exactly the lost node's ranks are reported
    assert all("RESTARTING" in c and "no room" in c for c in r["causes"].values()), r["causes"]
    assert "RESTARTING" in r["message"], r["message"]  # the ranks' identical causes, listed once
    assert r["after_removal_s"] < r["timeout_s"] + 30, r
    assert not r["leaks"], r
