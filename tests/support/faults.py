"""What the fault tests share: rank actors that block or fail part-way through a read on cue, and faults
injected into the reader's system calls. Actor classes made here travel to Ray's workers by value: the workers
need not import the tests."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import threading
import time

import raylazy
from raylazy.cluster.actor import RankLoader


def travel_by_value(module_name: str) -> None:
    """Functions and classes defined in `module_name` travel to Ray's workers by value (no import there)."""
    try:
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(sys.modules[module_name])
    except ImportError:  # Ray missing: the Ray tests skip
        pass


travel_by_value(__name__)



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


def plan_and_file(model_dir: str, tp: int = 2, rank: int = 0):
    """The plan, rank `rank`'s RankPlan, and the index of the file it reads most tensors from."""
    plan = raylazy.plan(model_dir, tp)
    rp = plan.ranks[rank]
    counts: dict[int, int] = {}
    for t in rp.tensors:
        for r in t.reads:
            counts[r.file] = counts.get(r.file, 0) + 1
    return plan, rp, max(counts, key=counts.get)


def tensors_of(rp, file_index: int) -> set[str]:
    return {t.name for t in rp.tensors if any(r.file == file_index for r in t.reads)}


def names_a_tensor(message: str, names: set[str]) -> bool:
    return any(repr(n) in message for n in names)


