"""The storage interface: a `Storage` per URI scheme opens `Source`s that read byte ranges into the caller's memory.

Every reader of checkpoint bytes (headers, index and config.json, the rank readers) goes through this
interface, so a new kind of storage is one module that subclasses `Storage` and `Source` and registers a
factory (`raylazy.storage.register_storage`). Implementations: local files (`raylazy.storage.local`) and object
storage (`raylazy.storage.objects`).

Contract of a `Source`: `readinto` fills the buffers completely or raises (`EOFError` when
the data ends first, `OSError` for any I/O failure); hints (`random_access`, `will_need`)
are advice and never raise. `Storage.open` raises `NotAFileError` for something that is
not a plain file (a directory, FIFO or device), `OSError` when it cannot open.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.costs import CostModel
from ..core.kinds import StorageKind


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
    #: The kind of storage it is on, for error messages (None: not known).
    kind: StorageKind | None = None
    #: Set by `abort`: every read from then on fails.
    aborted: bool = False

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

    def abort(self) -> None:
        """Make every later read fail with ECANCELED (a load given up: its reader threads end instead of reading on;
        a read blocked in the kernel ends when the storage answers)."""
        self.aborted = True

    def check_aborted(self) -> None:
        if self.aborted:
            raise given_up(self.uri)

    @abstractmethod
    def close(self) -> None:
        """Release the source (idempotent)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Listing:
    """What a directory holds: every name in it, and those that are plain files (links followed)."""

    names: frozenset[str]
    files: frozenset[str]


class Storage(ABC):
    """One URI scheme: opens sources and answers the directory questions checkpoint discovery asks."""

    @abstractmethod
    def open(self, uri: str) -> Source:
        """Open `uri` for reading; `NotAFileError` if it is not a plain file, `OSError` if it cannot be opened."""

    def reopen(self, uri: str, size: int, version: str) -> Source | None:
        """A source for version `version` (of `size` bytes) of `uri`, opened before, made without a request where
        every read checks the version (object storage: If-Match on the ETag); None where reads cannot check it
        (the caller opens and verifies the file)."""
        return None

    def cost_model(self, uri: str, kind: StorageKind | None = None) -> CostModel | None:
        """What reads of `uri` cost, for the planner's choice of reading row-split tensors whole or row by row and
        the readers' requests in flight and their size; None: a request costs little (a local disk: rows are read
        exactly, the readers' defaults). `kind`: `uri`'s kind, where the caller has it already."""
        return None

    def kind(self, uri: str) -> StorageKind | None:
        """The kind of storage `uri` is on (`raylazy.core.kinds`), for the plan and the readers to shape reads by;
        None: not known."""
        return None

    def listing(self, uri: str) -> Listing | None:
        """What directory `uri` holds; None if it is not a directory (object storage: one LIST request)."""
        if not self.is_dir(uri):
            return None
        names = self.list(uri)
        return Listing(frozenset(names), frozenset(n for n in names if self.is_file(self.join(uri, n))))

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


def given_up(uri: str) -> OSError:
    """The error of a read of `uri` made after its load was given up (ECANCELED)."""
    return OSError(errno.ECANCELED, "the load was given up (a read of it stalled or failed)", uri)


def scheme_of(uri: str) -> str:
    """The URI's scheme ('' for a plain path)."""
    head, sep, _ = uri.partition("://")
    return head if sep and head.isidentifier() else ""


def local_path(uri: str) -> str | None:
    """The local path `uri` names (a plain path or a `file://` URI, for libraries that open files themselves),
    None if it is not local."""
    if scheme_of(uri) not in ("", "file"):
        return None
    return uri[len("file://"):] if uri.startswith("file://") else uri
