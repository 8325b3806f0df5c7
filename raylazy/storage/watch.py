"""A rank's read run on a thread of its own, as a `Load` of its own, while the calling thread watches that load's
storage requests: one not answered within the storage timeout gives the read up (`StorageStallError`), since a
thread blocked in the kernel cannot be cancelled. Giving up aborts that load's reads alone, so its threads stop at
their next request and end once their blocked ones return (when the storage answers again, or its mount is
aborted); a later load in the process is not theirs, and their memory is not its: the shards a read given up
allocated are dropped with it, and tensors of the caller's it was filling (`out`) are refused to any later read
(`BuffersInUseError`) until its threads end."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

from ..errors import BuffersInUseError
from .verified import Load, stall_error

T = TypeVar("T")

#: How often the watcher looks at the requests in flight (seconds).
_POLL_S = 0.1


class _Outcome:
    """What the read thread leaves: its result or error, unless the watcher gave it up (`abandoned`): then nothing,
    so that nothing it held (a mapping of a file, a shard) outlives it. `ended`: the thread is done writing."""

    def __init__(self, out: Mapping | None):
        self.value, self.error, self.abandoned, self.ended = None, None, False, False
        self.out, self.uri = out or {}, ""


#: Reads given up whose threads still run, with the caller's tensors (`out`) they may still write into.
_GIVEN_UP: set[_Outcome] = set()
_LOCK = threading.Lock()


def watched(read: Callable[[], T], timeout_s: float, out: Mapping | None = None) -> T:
    """`read()` on a thread named raylazy-rank-read, as a load of its own; its result, or its error;
    StorageStallError (and the load's reads aborted) as soon as a request of it has waited more than `timeout_s`
    seconds. `out`: the caller's tensors it fills (BuffersInUseError first if a read given up may still write
    into one)."""
    check_free(out)
    load, outcome = Load(), _Outcome(out)
    thread = threading.Thread(target=load.run, args=(_run, read, outcome), name="raylazy-rank-read", daemon=True)
    thread.start()
    while True:
        thread.join(_POLL_S)
        if not thread.is_alive():
            if outcome.error is not None:
                raise outcome.error
            return outcome.value
        late = load.overdue(timeout_s)
        if late is not None:
            with _LOCK:
                outcome.abandoned, outcome.uri = True, late.source.uri
                if not outcome.ended:
                    _GIVEN_UP.add(outcome)
            load.abort()
            raise stall_error(late, timeout_s)


def check_free(out: Mapping | None) -> None:
    """BuffersInUseError if a read given up in this process may still write into a tensor of `out`
    ({name: tensor}: one sharing its storage)."""
    with _LOCK:
        busy = {_where(t): o.uri for o in _GIVEN_UP for t in o.out.values() if t.nbytes}
    for name, t in (out or {}).items():
        if _where(t) in busy:
            raise BuffersInUseError(
                f"{name!r}: a read of {busy[_where(t)]} given up earlier in this process (a StorageStallError) may "
                f"still write into this tensor ({t.nbytes} bytes on {t.device}) when its storage answers the "
                f"requests it left blocked; {len(busy)} tensor(s) wait on such reads: fill it once the storage "
                "answers them or its mount is aborted, or load into new tensors (a load, not a reload)")


def _where(t) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _run(read: Callable, outcome: _Outcome) -> None:
    try:
        value = read()
        if not outcome.abandoned:
            outcome.value = value
    except BaseException as e:  # noqa: BLE001  (re-raised in the watcher's thread)
        if not outcome.abandoned:
            outcome.error = e
    finally:
        with _LOCK:
            outcome.ended = True
            _GIVEN_UP.discard(outcome)
