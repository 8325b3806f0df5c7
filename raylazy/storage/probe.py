"""How long a request to a network mount waits and how many requests it serves at once, timed where every read
reaches the storage and the kernel does not say them (`probed`): a few reads of a checkpoint file's first bytes
(within its header, which every load reads), one at a time, then several at once, once a mount for the process."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable

#: The reads: `SERIAL` one at a time (the first of the header's 8-byte length, the others of its first
#: `READ_BYTES` at most), then `TOGETHER` at once, from as many threads.
SERIAL, TOGETHER, READ_BYTES = 4, 12, 4096
#: Where a request waits less, the concurrent reads' ends spread by the scheduling of this process's and the
#: server's threads (milliseconds on a busy machine) as much as by the storage's queue: no depth is told from them.
DEPTH_MIN_S = 0.02
#: Longest a probe is waited for (a mount that stops answering): no figures then.
TIMEOUT_S = 5.0

#: (mount point, device) -> what its probe found, for the process.
_PROBED: dict[tuple[str, str], tuple[float, int] | None] = {}
_LOCK = threading.Lock()


def probed(mount_point: str, device: str, find: Callable[[], str | None]) -> tuple[float, int] | None:
    """`measure` of the file `find()` names on the mount at `mount_point` (device "MAJOR:MINOR"), once for the
    process: concurrent callers wait for the one probe, later ones get what it found without `find` looking for
    a file (a listing on the mount); None, and nothing kept, where it finds none."""
    with _LOCK:
        if (mount_point, device) not in _PROBED:
            path = find()
            if path is None:
                return None
            _PROBED[mount_point, device] = measure(path)
        return _PROBED[mount_point, device]


def measure(path: str, timeout_s: float = TIMEOUT_S) -> tuple[float, int] | None:
    """(seconds a read of file `path` waits, reads its storage serves at once) from `SERIAL` reads one at a time
    (their median) and `TOGETHER` at once: each of these taken to be served for the half wait before it ended (one
    queued behind another ends a whole wait after it), the most served at the same moment. The depth is 0 (not
    told) where that is all of them (the storage serves at least as many) or a read waits under `DEPTH_MIN_S`.
    None where the file cannot be read, is too small to hold a header's length, or the reads take over
    `timeout_s` (they are left to end on a thread of their own)."""
    found: list[tuple[float, int] | None] = []
    thread = threading.Thread(target=lambda: found.append(_timed(path)), name="raylazy-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return found[0] if found else None


def _timed(path: str) -> tuple[float, int] | None:
    """`measure`'s reads and figures, on the calling thread."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        t = time.perf_counter()
        head = os.pread(fd, 8, 0)
        waits = [time.perf_counter() - t]
        if len(head) < 8:
            return None
        n = min(READ_BYTES, 8 + int.from_bytes(head, "little"))
        for _ in range(SERIAL - 1):
            t = time.perf_counter()
            os.pread(fd, n, 0)
            waits.append(time.perf_counter() - t)
        ends = _together(fd, n)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(ends) < TOGETHER:
        return None
    wait = statistics.median(waits)
    at_once = max(sum(end - wait / 2 <= e <= end for end in ends) for e in ends)
    return wait, at_once if wait >= DEPTH_MIN_S and at_once < TOGETHER else 0


def _together(fd: int, n: int) -> list[float]:
    """When each of `TOGETHER` reads of `n` bytes of `fd` started at once ended; a read that failed is left out."""
    ready, ends = threading.Barrier(TOGETHER), []

    def read() -> None:
        ready.wait()
        try:
            os.pread(fd, n, 0)
        except OSError:
            return
        ends.append(time.perf_counter())

    threads = [threading.Thread(target=read, name="raylazy-probe-read", daemon=True) for _ in range(TOGETHER)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ends
