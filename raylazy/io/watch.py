"""A rank's read run on a thread of its own while the calling thread watches its storage requests: one not answered
within the storage timeout gives the read up (`StorageStallError`), since a thread blocked in the kernel cannot be
cancelled. Giving up aborts the process's open sources, so the read's threads stop at their next request and end
once their blocked ones return (when the storage answers again, or its mount is aborted)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from ..storage import abort_reads, overdue, stall_error

T = TypeVar("T")

#: How often the watcher looks at the requests in flight (seconds).
_POLL_S = 0.1


class _Outcome:
    """What the read thread leaves: its result or error, unless the watcher gave it up (`abandoned`): then nothing,
    so that nothing it held (a mapping of a file, a shard) outlives it."""

    def __init__(self):
        self.value, self.error, self.abandoned = None, None, False


def watched(read: Callable[[], T], timeout_s: float) -> T:
    """`read()` on a thread named raylazy-rank-read; its result, or its error; StorageStallError (and the process's
    reads aborted) as soon as a request of this process has waited more than `timeout_s` seconds."""
    outcome = _Outcome()
    thread = threading.Thread(target=_run, args=(read, outcome), name="raylazy-rank-read", daemon=True)
    thread.start()
    while True:
        thread.join(_POLL_S)
        if not thread.is_alive():
            if outcome.error is not None:
                raise outcome.error
            return outcome.value
        late = overdue(timeout_s)
        if late is not None:
            outcome.abandoned = True
            abort_reads()
            raise stall_error(late, timeout_s)


def _run(read: Callable, outcome: _Outcome) -> None:
    try:
        value = read()
        if not outcome.abandoned:
            outcome.value = value
    except BaseException as e:  # noqa: BLE001  (re-raised in the watcher's thread)
        if not outcome.abandoned:
            outcome.error = e
