"""What a rank's reader reports: `ReadStats`, and the thread-safe byte counter behind its progress."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

Progress = Callable[[int], None]


@dataclass
class ReadStats:
    """What one rank's reader did; every field means the same for every backend."""

    backend: str
    device: str
    #: Bytes the rank's shards need (padding excluded).
    bytes_needed: int = 0
    #: Bytes read from storage: the needed ones plus any gaps read to save requests.
    bytes_read: int = 0
    #: Bytes of the rank's shards that other ranks of its node read (cooperative and exchange reads): kept from
    #: their stripes through the page cache, or received over the exchange.
    bytes_received: int = 0
    #: Bytes of shards copied from the rank with the same coordinates in a live replica (`raylazy.cluster.replicas`),
    #: instead of reading them from storage (`bytes_read` is then 0).
    bytes_from_replica: int = 0
    #: Read requests issued to storage: contiguous byte ranges read (however the reader splits them into calls).
    requests: int = 0
    seconds: float = 0.0
    #: Most memory the reader holds outside the shards (staging buffers), in bytes.
    staging_bytes: int = 0
    #: Staging buffers alive at once (ranged to a GPU: windows; fastsafetensors: file batches).
    staging_buffers: int = 0
    #: GPUDirect Storage was used (fastsafetensors).
    gds: bool = False
    #: Why GPUDirect Storage was abandoned during this load ("" if it was not).
    gds_fallback: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes_needed / self.seconds / 1e9 if self.seconds else 0.0


class Counter:
    """A thread-safe byte counter that also forwards increments to a progress callback."""

    def __init__(self, on_progress: Progress | None = None):
        self.value = 0
        self._lock = threading.Lock()
        self._on_progress = on_progress

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n
        if self._on_progress is not None:
            self._on_progress(n)
