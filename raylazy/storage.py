"""Where checkpoint bytes come from: one `Storage` per URI scheme opens `Source`s that read byte ranges
into the caller's memory.

Every reader of checkpoint bytes (headers, index and config.json, the rank readers) goes
through this interface, so a new kind of storage (an object store: `s3://...`) is one
module that subclasses `Storage` and `Source` and calls `register_storage`. A plain path
and a `file://` URI are local files (`LocalStorage`); `s3://`, `gs://` and `az://` are object
storage (`raylazy.objectstore`, imported when first used: the optional `s3` extra). A storage is
built from its scheme and the caller's `storage_options` (credentials, endpoint, retries), one
instance per distinct set.

Contract of a `Source`: `readinto` fills the buffers completely or raises (`EOFError` when
the data ends first, `OSError` for any I/O failure); hints (`random_access`, `will_need`)
are advice and never raise. `Storage.open` raises `NotAFileError` for something that is
not a plain file (a directory, FIFO or device), `OSError` when it cannot open.
"""

from __future__ import annotations

import errno
import os
import stat
from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Sequence

from .errors import ConfigurationError, UnsupportedStorageError

#: Bytes per POSIX_FADV_WILLNEED call: the kernel reads at most max(read-ahead, max I/O size) per call.
_HINT_BYTES = 128 << 10
#: Most buffers one preadv takes.
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: preadv flag for "only what is cached" (0 where the platform lacks it).
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class NotAFileError(OSError):
    """The URI names something that is not a plain file (a directory, FIFO or device)."""


class Source(ABC):
    """One opened file or object: its URI and size, and positional reads into caller buffers."""

    uri: str
    size: int
    #: The opened version's tag (an object's ETag; "" where the storage has none, as for local files).
    version: str = ""
    #: Reads this source serves best at once (object storage: its requests in flight); the ranged reader keeps at
    #: least this many windows in flight.
    concurrency: int = 1

    @abstractmethod
    def read(self, offset: int, n: int) -> bytes:
        """Up to `n` bytes from `offset` (fewer only where the data ends)."""

    @abstractmethod
    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill `buffers`, one after another, with the bytes from `offset` on, completely or raise."""

    def try_readinto(self, offset: int, buffer: memoryview) -> int:
        """Copy into `buffer` what can be had without waiting on storage (e.g. cached pages); returns
        the bytes copied, 0 if none (or if the storage cannot tell)."""
        return 0

    def random_access(self) -> None:
        """Hint: reads will be scattered; read nothing ahead of them."""

    def will_need(self, start: int, end: int) -> None:
        """Hint: bytes [start, end) will be read soon; start fetching them."""

    @abstractmethod
    def close(self) -> None:
        """Release the source (idempotent)."""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Storage(ABC):
    """One URI scheme: opens sources and answers the directory questions checkpoint discovery asks."""

    #: The planner's `max_gap` when the caller gives none: row gaps up to this many bytes are read through
    #: (0 locally: a positional read costs little; object storage pays per request).
    default_max_gap: int = 0

    @abstractmethod
    def open(self, uri: str) -> Source:
        """Open `uri` for reading; `NotAFileError` if it is not a plain file, `OSError` if it cannot be opened."""

    @abstractmethod
    def list(self, uri: str) -> list[str]:
        """The names in directory `uri`."""

    @abstractmethod
    def exists(self, uri: str) -> bool: ...

    @abstractmethod
    def is_file(self, uri: str) -> bool:
        """True for a plain file (following links)."""

    @abstractmethod
    def is_dir(self, uri: str) -> bool: ...

    def absolute(self, uri: str) -> str:
        """`uri` in the form plans keep (the local storage makes paths absolute)."""
        return uri

    def join(self, uri: str, name: str) -> str:
        return uri.rstrip("/") + "/" + name

    def split(self, uri: str) -> tuple[str, str]:
        """(parent, name)."""
        parent, _, name = uri.rpartition("/")
        return parent, name


class LocalSource(Source):
    """A local file held open by descriptor: every read is one `os.preadv`/`os.pread` at an offset."""

    def __init__(self, uri: str, fd: int, size: int):
        self.uri, self.fd, self.size = uri, fd, size

    def read(self, offset: int, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = os.pread(self.fd, n - got, offset + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """preadv (at most _IOV_MAX buffers a call) until every buffer is full; short reads continue, the end of
        the file raises EOFError."""
        bufs, i = list(buffers), 0
        while i < len(bufs):
            got = os.preadv(self.fd, bufs[i : i + _IOV_MAX], offset)
            if got == 0:
                raise EOFError(f"{sum(len(b) for b in bufs[i:])} bytes missing at offset {offset}")
            offset += got
            while i < len(bufs) and got >= len(bufs[i]):
                got -= len(bufs[i])
                i += 1
            if got:
                bufs[i] = bufs[i][got:]

    def try_readinto(self, offset: int, buffer: memoryview) -> int:
        """One preadv with RWF_NOWAIT: the bytes that were cached (0 if none, or if the kernel or file
        system does not support it, which then stops further tries in this process)."""
        global _NOWAIT
        if not _NOWAIT:
            return 0
        try:
            return os.preadv(self.fd, [buffer], offset, _NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _NOWAIT = 0
            return 0

    def random_access(self) -> None:
        """POSIX_FADV_RANDOM. Set it before the first read: a plain read of the header would read ahead
        and mark a page for more read-ahead, and a later reader that reaches the marked page (even one
        with POSIX_FADV_RANDOM set) reads ahead from there, each window marking the next: a rank reading
        rows with gaps would then pull the whole file from storage."""
        try:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass

    def will_need(self, start: int, end: int) -> None:
        """POSIX_FADV_WILLNEED in pieces of _HINT_BYTES, so the kernel starts reading all of [start, end)."""
        try:
            for a in range(start, end, _HINT_BYTES):
                os.posix_fadvise(self.fd, a, min(_HINT_BYTES, end - a), os.POSIX_FADV_WILLNEED)
        except OSError:
            pass

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class LocalStorage(Storage):
    """Local files: plain paths or `file://` URIs (no storage options)."""

    def __init__(self, **storage_options: Any):
        if storage_options:
            raise ConfigurationError(f"local files take no storage_options, got {sorted(storage_options)}: "
                                     "pass storage_options only for object storage (s3://, gs://, az://)")

    def open(self, uri: str) -> LocalSource:
        path = _local_path(uri)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in a file's place must not block the open
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAFileError(errno.EINVAL, "not a regular file (a directory, FIFO or device)", uri)
        except BaseException:
            os.close(fd)
            raise
        return LocalSource(uri, fd, st.st_size)

    def list(self, uri: str) -> list[str]:
        return os.listdir(_local_path(uri))

    def exists(self, uri: str) -> bool:
        return os.path.exists(_local_path(uri))

    def is_file(self, uri: str) -> bool:
        return os.path.isfile(_local_path(uri))

    def is_dir(self, uri: str) -> bool:
        return os.path.isdir(_local_path(uri))

    def absolute(self, uri: str) -> str:
        return os.path.abspath(_local_path(uri))

    def join(self, uri: str, name: str) -> str:
        return os.path.join(uri, name)

    def split(self, uri: str) -> tuple[str, str]:
        return os.path.dirname(uri), os.path.basename(uri)


def _local_path(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri


def local_path(uri: str) -> str | None:
    """The local path `uri` names (for libraries that open files themselves), None if it is not local."""
    return _local_path(uri) if scheme_of(uri) in ("", "file") else None


def _object_storage(scheme: str) -> Callable[..., Storage]:
    def factory(**storage_options: Any) -> Storage:
        try:
            from .objectstore import ObjectStorage
        except ImportError as e:
            raise UnsupportedStorageError(f"{scheme}:// needs the obstore package ({e}): pip install 'raylazy[s3]'") from None
        return ObjectStorage(scheme, storage_options)
    return factory


#: Object-storage schemes served by `raylazy.objectstore` (obstore: S3, Google Cloud Storage, Azure Blob).
OBJECT_SCHEMES = ("s3", "gs", "az")
_FACTORIES: dict[str, Callable[..., Storage]] = {"": LocalStorage, "file": LocalStorage,
                                                 **{s: _object_storage(s) for s in OBJECT_SCHEMES}}
_STORAGES: dict[tuple[str, str], Storage] = {}


def register_storage(scheme: str, factory: Callable[..., Storage]) -> None:
    """Serve URIs `scheme://...` with the Storage `factory(**storage_options)` returns (called once per distinct
    set of storage options, when first needed; with none, `factory()`)."""
    _FACTORIES[scheme] = factory
    for key in [k for k in _STORAGES if k[0] == scheme]:
        del _STORAGES[key]


def scheme_of(uri: str) -> str:
    """The URI's scheme ('' for a plain path)."""
    head, sep, _ = uri.partition("://")
    return head if sep and head.isidentifier() else ""


def storage_for(uri: str, storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The Storage serving `uri` (a plain path or a `file://` URI: the local one), built with `storage_options`."""
    scheme = scheme_of(uri)
    options = dict(storage_options or {})
    key = (scheme, repr(sorted(options.items())))
    storage = _STORAGES.get(key)
    if storage is None:
        factory = _FACTORIES.get(scheme)
        if factory is None:
            raise UnsupportedStorageError(
                f"{uri}: no storage serves the scheme {scheme!r} (known: "
                f"{', '.join(repr(s) for s in sorted(_FACTORIES) if s)}); register one with "
                "raylazy.storage.register_storage"
            )
        storage = _STORAGES[key] = factory(**options)
    return storage


def open_source(uri: str, storage_options: Mapping[str, Any] | None = None) -> Source:
    """Open `uri` with the storage serving it."""
    return storage_for(uri, storage_options).open(uri)
