"""Local files (plain paths and `file://` URIs): sources held open by descriptor, every read one `os.preadv`."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from typing import Any

from ..core.costs import CostModel, for_kind
from ..core.kinds import StorageKind
from ..errors import ConfigurationError
from .base import NotAFileError, Source, Storage, local_path
from .kinds import direct_io, storage_kind

#: Bytes per POSIX_FADV_WILLNEED call: the kernel reads at most max(read-ahead, max I/O size) per call.
_HINT_BYTES = 128 << 10
#: Most buffers one preadv takes.
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: preadv flag for "only what is cached" (0 where the platform lacks it).
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class LocalSource(Source):
    """A local file held open by descriptor: every read is one `os.preadv`/`os.pread` at an offset. `cached`: the
    kernel keeps its pages (False for a FUSE file served with direct_io, where read-ahead hints are not given)."""

    def __init__(self, uri: str, fd: int, size: int, cached: bool = True):
        self.uri, self.fd, self.size, self.cached = uri, fd, size, cached
        self._kind: StorageKind | None = None

    @property
    def kind(self) -> StorageKind:
        """The storage kind, found when first asked (for an error message: a reader's process reads nothing but
        the checkpoint otherwise) from the mount table alone, touching nothing on the mount (it may be stalled)."""
        if self._kind is None:
            self._kind = storage_kind(os.path.dirname(os.path.abspath(local_path(self.uri))), uncached=not self.cached,
                                      resolve=False)
        return self._kind

    def read(self, offset: int, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            self.check_aborted()
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
            self.check_aborted()
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
        self.check_aborted()
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
        """POSIX_FADV_WILLNEED in pieces of _HINT_BYTES, so the kernel starts reading all of [start, end). Not where
        the kernel keeps no pages (direct_io): there it would read them into the page cache anyway, for no read,
        and every byte would be fetched from the storage twice."""
        if not self.cached:
            return
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
        path = local_path(uri)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO in a file's place must not block the open
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAFileError(errno.EINVAL, "not a regular file (a directory, FIFO or device)", uri)
        except BaseException:
            os.close(fd)
            raise
        return LocalSource(uri, fd, st.st_size, cached=not direct_io(fd))

    def kind(self, uri: str) -> StorageKind:
        return storage_kind(local_path(uri))

    def cost_model(self, uri: str, kind: StorageKind | None = None) -> CostModel | None:
        """A network file system's figures by its kind (`raylazy.core.costs.for_kind`); None on a local disk."""
        return for_kind(kind or self.kind(uri))

    def list(self, uri: str) -> list[str]:
        return os.listdir(local_path(uri))

    def exists(self, uri: str) -> bool:
        return os.path.exists(local_path(uri))

    def is_file(self, uri: str) -> bool:
        return os.path.isfile(local_path(uri))

    def is_dir(self, uri: str) -> bool:
        return os.path.isdir(local_path(uri))

    def absolute(self, uri: str) -> str:
        return os.path.abspath(local_path(uri))

    def join(self, uri: str, name: str) -> str:
        return os.path.join(uri, name)

    def split(self, uri: str) -> tuple[str, str]:
        return os.path.dirname(uri), os.path.basename(uri)
