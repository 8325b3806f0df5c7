"""What every reader shares: checking files against the plan, typing shard bytes, and statistics."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..dtypes import itemsize, torch_dtype
from ..errors import FileChangedError, ReadError
from ..header import MAX_HEADER_BYTES
from ..plans import FileRef, TensorShard
from ..storage import NotAFileError, Source, open_source

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


def open_verified(ref: FileRef) -> Source:
    """Open a planned file after checking its size and header digest match the plan; read-ahead is off
    (the reader hints what it needs). The caller closes the returned source."""
    try:
        source = open_source(ref.uri)
    except NotAFileError:
        raise FileChangedError(f"{ref.uri}: is no longer a regular file (a directory, FIFO or device); it was "
                               "replaced since planning: plan again") from None
    except OSError as e:
        raise ReadError(f"{ref.uri}: cannot open planned checkpoint file: {e.strerror}") from None
    try:
        if source.size != ref.size:
            raise FileChangedError(
                f"{ref.uri}: file is {source.size} bytes but was {ref.size} when planned; it was replaced or "
                "truncated since planning: plan again"
            )
        source.random_access()
        prefix = source.read(0, 8)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        head = prefix + source.read(8, n) if 0 <= n <= MAX_HEADER_BYTES else prefix
        if hashlib.sha256(head).hexdigest() != ref.digest:
            raise FileChangedError(f"{ref.uri}: header differs from the one planned; the file was replaced: plan again")
    except OSError as e:
        source.close()
        raise ReadError(f"{ref.uri}: cannot read header: {e.strerror}") from None
    except BaseException:
        source.close()
        raise
    return source


def typed(flat, shard: TensorShard):
    """View a shard's flat uint8 buffer with its dtype and shape (sub-byte dtypes stay uint8 rows)."""
    if itemsize(shard.dtype) is None:
        rows = 1
        for d in shard.shape[:-1]:
            rows *= d
        return flat.reshape(tuple(shard.shape[:-1]) + (-1,)) if rows and flat.numel() % rows == 0 else flat
    return flat.view(torch_dtype(shard.dtype)).reshape(shard.shape)

