"""What a rank's reader reports: `ReadStats` (the plan's figures and what was measured), the `Meter` that measures a
read, and the thread-safe byte counter behind its progress."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

Progress = Callable[[int], None]


@dataclass
class ReadStats:
    """What one rank's reader did; every field means the same for every backend.

    Two kinds of figures: `bytes_read` and `requests` are the plan's (or the node schedule's) arithmetic, what the
    reader was asked to read, not counted while it read; `rchar` and `seconds` are measured over the read, and
    `bytes_needed` counts the bytes that landed in the shards. docs/testing.md says which test checks which."""

    backend: str
    device: str
    #: Bytes the rank's shards need (padding excluded), counted as they land.
    bytes_needed: int = 0
    #: Bytes to read from storage as planned, not measured: the rank's ranges plus any gaps read to save requests
    #: (ranged); its share of its node's union as the node schedule cuts it (cooperative, exchange); the whole
    #: tensors fastsafetensors reads; 0 for a rank copying from a replica. Measured: `rchar`.
    bytes_read: int = 0
    #: Bytes of the rank's shards that other ranks of its node read (cooperative and exchange reads): kept from
    #: their stripes through the page cache, or received over the exchange.
    bytes_received: int = 0
    #: Bytes of shards copied from the rank with the same coordinates in a live replica (`raylazy.cluster.loading`),
    #: instead of reading them from storage (`bytes_read` is then 0).
    bytes_from_replica: int = 0
    #: Bytes of shards copied out of a holder of the checkpoint in Ray (`raylazy.hold`) instead of read from storage.
    bytes_from_holder: int = 0
    #: Read requests to storage as planned, not measured: contiguous byte ranges (however the reader splits them
    #: into calls), the rank's stripes (cooperative stripe readers, exchange; 0 without stripe readers, where the
    #: kernel reads on page faults), or fastsafetensors' byte runs.
    requests: int = 0
    #: Measured: wall seconds of the read.
    seconds: float = 0.0
    #: Measured: bytes that read system calls (read, pread, preadv...) of the rank's process returned during the
    #: read: the `rchar` delta of /proc/self/io, over all its threads (the header checks included, and any other
    #: thread of the process reading meanwhile). Pages of mapped files are not read calls: the cooperative
    #: reader's copies and its stripe readers' MADV_POPULATE_READ do not count, nor does GPUDirect Storage. It
    #: is the same whether the bytes came from storage or the page cache. None where /proc/self/io is absent.
    rchar: int | None = None
    #: Most memory the reader holds outside the shards (staging buffers), in bytes.
    staging_bytes: int = 0
    #: Staging buffers alive at once (ranged to a GPU: windows; fastsafetensors: file batches).
    staging_buffers: int = 0
    #: The kind of storage read (`raylazy.core.kinds.StorageKind.name`: "local", "nfs", "fuse", "object", ...), as
    #: planned; "" where not known.
    storage: str = ""
    #: How the reads were shaped (`ReaderOptions.shaped`): the most read requests the reader keeps in flight (its
    #: reading threads; 0 where the kernel reads on page faults) and the largest one it makes, in bytes.
    in_flight: int = 0
    request_bytes: int = 0
    #: GPUDirect Storage was used (fastsafetensors).
    gds: bool = False
    #: Why GPUDirect Storage was abandoned during this load ("" if it was not).
    gds_fallback: str = ""

    @property
    def gbps(self) -> float:
        return self.bytes_needed / self.seconds / 1e9 if self.seconds else 0.0


_IO_LINE = re.compile(rb"^(\w+): (\d+)$", re.M)


def proc_io(pid: int | str = "self") -> dict[str, int] | None:
    """/proc/<pid>/io as numbers (`rchar`: bytes the process's read calls returned, from storage or the page cache
    alike; `read_bytes`: bytes it made storage deliver, its page faults included), and `probe`: the bytes this
    reading itself read of that file, counted in the reading process's rchar only after it. None where the file
    cannot be read."""
    try:
        with open(f"/proc/{pid}/io", "rb", buffering=0) as f:
            text = f.read()
    except OSError:
        return None
    return {k.decode(): int(v) for k, v in _IO_LINE.findall(text)} | {"probe": len(text)}


def io_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """rchar and read_bytes between two `proc_io()` readings of this process, the first reading's own bytes out."""
    return {"rchar": after["rchar"] - before["rchar"] - before["probe"],
            "read_bytes": after["read_bytes"] - before["read_bytes"]}


class Meter:
    """Measures one read from its creation: `elapsed()`, or `stop(stats)`, which fills `stats.seconds` and
    `stats.rchar`."""

    def __init__(self):
        self.io = proc_io()
        self.start = time.perf_counter()

    def elapsed(self) -> tuple[float, int | None]:
        """(seconds, rchar bytes) since the meter was made."""
        seconds, now = time.perf_counter() - self.start, proc_io()
        return seconds, None if now is None or self.io is None else io_delta(self.io, now)["rchar"]

    def stop(self, stats: ReadStats) -> ReadStats:
        stats.seconds, stats.rchar = self.elapsed()
        return stats


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


@dataclass
class ServingStats:
    """What serving a consumer's regions took (`raylazy.io.serving`). Counted: `regions`, `bytes_needed` (the distinct regions wanted, their bytes),
    `in_place_bytes` (of those, read straight into their destination), `opaque_*` (regions an op raylazy cannot
    follow took, read at once as far as narrowed; `whole_opaque`: whole tensors), `unplanned_*` (regions only a
    second run took). Planned (the readers' plan or node schedule, not measured): `planned_bytes_read`,
    `planned_requests`, `node_bytes` (the node's union, once). Measured: `received_bytes` (from the node's other
    processes), `read_seconds`."""

    backend: str = "ranged"
    #: The storage kind read (`ReadStats.storage`) and the read shape: most requests in flight, their largest size.
    storage: str = ""
    in_flight: int = 0
    request_bytes: int = 0
    node_processes: int = 1
    regions: int = 0
    bytes_needed: int = 0
    in_place_bytes: int = 0
    planned_bytes_read: int = 0
    planned_requests: int = 0
    node_bytes: int = 0
    received_bytes: int = 0
    batches: int = 0
    read_seconds: float = 0.0
    opaque_regions: int = 0
    opaque_bytes: int = 0
    whole_opaque: int = 0
    unplanned_regions: int = 0
    unplanned_bytes: int = 0

    def add_read(self, stats: ReadStats) -> None:
        self.planned_bytes_read += stats.bytes_read
        self.planned_requests += stats.requests
        self.received_bytes += stats.bytes_received
        self.read_seconds += stats.seconds
        self.in_flight, self.request_bytes = max(self.in_flight, stats.in_flight), max(self.request_bytes, stats.request_bytes)

    def count_opaque(self, opaque: dict) -> None:
        """The regions ops raylazy cannot follow took (region -> takes)."""
        self.opaque_regions, self.opaque_bytes = len(opaque), sum(r.nbytes for r in opaque)
        self.whole_opaque = sum(r.sizes == r.tensor.shape for r in opaque)
