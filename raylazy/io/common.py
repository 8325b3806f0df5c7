"""What every reader shares: checking files against the plan, typing shard bytes, and statistics."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..dtypes import itemsize, torch_dtype
from ..errors import FileChangedError, ReadError
from ..header import MAX_HEADER_BYTES
from ..plans import FileRef, TensorShard

Progress = Callable[[int], None]


@dataclass
class ReadStats:
    """What one rank's reader did: bytes its shards needed, bytes it read, requests, time."""

    backend: str
    device: str
    bytes_needed: int = 0
    bytes_read: int = 0
    requests: int = 0
    seconds: float = 0.0
    #: Most host memory the reader holds outside the shards (staging buffers), in bytes.
    staging_bytes: int = 0
    extra: dict = field(default_factory=dict)

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


def open_verified(ref: FileRef) -> int:
    """Open a planned file read-only after checking its size and header digest match the plan."""
    try:
        fd = os.open(ref.path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put in its place must not block the open
    except OSError as e:
        raise ReadError(f"{ref.path}: cannot open planned checkpoint file: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size != ref.size:
            raise FileChangedError(
                f"{ref.path}: file is {size} bytes but was {ref.size} when planned; it was replaced or truncated "
                "since planning: plan again"
            )
        _no_readahead(fd)
        prefix = os.pread(fd, 8, 0)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        head = prefix + os.pread(fd, n, 8) if 0 <= n <= MAX_HEADER_BYTES else prefix
        if hashlib.sha256(head).hexdigest() != ref.digest:
            raise FileChangedError(f"{ref.path}: header differs from the one planned; the file was replaced: plan again")
    except OSError as e:
        os.close(fd)
        raise ReadError(f"{ref.path}: cannot read header: {e.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _no_readahead(fd: int) -> None:
    """POSIX_FADV_RANDOM before the first read: a plain read of the header would read ahead and mark a
    page for more read-ahead, and a later reader that reaches the marked page (even one with
    POSIX_FADV_RANDOM set) reads ahead from there, each window marking the next: a rank reading rows
    with gaps then pulls the whole file from storage."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:  # advice only (e.g. not a regular file: the checks around report that)
        pass


def typed(flat, shard: TensorShard):
    """View a shard's flat uint8 buffer with its dtype and shape (sub-byte dtypes stay uint8 rows)."""
    if itemsize(shard.dtype) is None:
        rows = 1
        for d in shard.shape[:-1]:
            rows *= d
        return flat.reshape(tuple(shard.shape[:-1]) + (-1,)) if rows and flat.numel() % rows == 0 else flat
    return flat.view(torch_dtype(shard.dtype)).reshape(shard.shape)

