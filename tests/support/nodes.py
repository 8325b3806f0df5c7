"""A node's processes loading one checkpoint together, as threads of the test's process (a `NodeGroup` of
`raylazy.io.serving` each: `member(rank)`)."""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace


class ThreadNode:
    """A node's `size` processes as threads of this one (`member(rank)`: a `NodeGroup`), gathering over a barrier."""

    def __init__(self, size: int):
        self.size, self._got, self._barrier = size, [None] * size, threading.Barrier(size, timeout=60)

    def gather(self, rank: int, obj):
        self._got[rank] = obj

        def wait() -> list:
            self._barrier.wait()
            out = list(self._got)
            self._barrier.wait()
            return out

        return wait

    def abort(self) -> None:
        """A member failed: the others' gatherings fail at once (BrokenBarrierError) instead of waiting for it."""
        self._barrier.abort()

    def member(self, rank: int) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, size=self.size, gather=functools.partial(self.gather, rank))
