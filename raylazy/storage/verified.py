"""Planned checkpoint files opened for a reader: each checked to be the one planned (size, version tag, header
digest) before a byte is taken from it; each load's reads in flight (`Load`), for a reader to tell a storage that
stopped answering (`Load.overdue`) and to stop that load's reads (`Load.abort`); storage failures while reading named
as ReadErrors."""

from __future__ import annotations

import contextvars
import hashlib
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

from ..core.header import MAX_HEADER_BYTES
from ..core.plans import FileRef, RankPlan
from ..errors import FileChangedError, ReadError, StorageStallError
from .base import NotAFileError, Source, given_up
from .registry import storage_for

T = TypeVar("T")


def open_planned(plan: RankPlan, f: int, storage_options: Mapping[str, Any] | None = None) -> Source:
    """`open_verified` for file `f` of a rank plan; a failure also names the rank's tensors that file holds."""
    try:
        return open_verified(plan.files[f], storage_options)
    except (FileChangedError, ReadError) as e:
        names = [t.name for t in plan.tensors if any(r.file == f for r in t.reads)]
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        raise type(e)(f"{e} (needed for tensor {names[0]!r}{more})" if names else str(e)) from None


def open_verified(ref: FileRef, storage_options: Mapping[str, Any] | None = None) -> Source:
    """Open a planned file after checking its size, version tag (an object's ETag) and header digest match the
    plan; read-ahead is off (the reader hints what it needs). The caller closes the returned source.

    Where every read checks the planned version itself (object storage: If-Match), the file is reopened at that
    version without a request: a replaced object fails its first read with a FileChangedError."""
    storage = storage_for(ref.uri, storage_options)
    source = storage.reopen(ref.uri, ref.size, ref.version) if ref.version else None
    if source is not None:
        return _opened(source)
    try:
        with requested(ref.uri, "opening it"):
            source = storage.open(ref.uri)
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
        if ref.version and source.version != ref.version:
            raise FileChangedError(f"{ref.uri}: the object's ETag is {source.version} but was {ref.version} when "
                                   "planned; it was replaced since planning: plan again")
        source.random_access()
        with reading(source, "checking its header"):
            prefix = source.read(0, 8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            head = prefix + source.read(8, n) if 0 <= n <= MAX_HEADER_BYTES else prefix
        if hashlib.sha256(head).hexdigest() != ref.digest:
            raise FileChangedError(f"{ref.uri}: header differs from the one planned; the file was replaced: plan again")
    except BaseException:
        source.close()
        raise
    return _opened(source)


def _opened(source: Source) -> Source:
    load = _LOAD.get() or _OUTSIDE
    with _LOCK:
        load.sources.add(source)
    return source


@contextmanager
def open_planned_files(plan: RankPlan, files: Iterable[int], storage_options: Mapping[str, Any] | None = None,
                       opened: Mapping[int, Source] | None = None) -> Iterator[dict[int, Source]]:
    """`open_planned` each of `files` (plan file indices); yields {index: Source} and closes them on leaving.
    Files in `opened` (opened and checked by the caller, who reads several plans of one load in turn) are used
    as they are and left open: a file is checked once per load."""
    opened = opened or {}
    sources: dict[int, Source] = {}
    mine: list[Source] = []
    try:
        for f in files:
            if f in opened:
                sources[f] = opened[f]
            else:
                sources[f] = open_planned(plan, f, storage_options)
                mine.append(sources[f])
        yield sources
    finally:
        for source in mine:
            source.close()


class Request(NamedTuple):
    """A read in flight (`reading`): when it began (time.monotonic), from which source, what it reads."""

    began: float
    source: Source
    what: str


class Load:
    """One load's reads: those in flight (`reading` in a thread running in its context: `run`), for `overdue`, and
    the sources it opened (`open_verified`), for `abort`. A fault ends the load it belongs to and nothing else: a
    read it gave up, still blocked in the kernel, is no later load's. The threads a load starts run in its context
    (`pool.submit(contextvars.copy_context().run, fn, ...)`)."""

    def __init__(self):
        self.in_flight: dict[int, Request] = {}
        self.sources: weakref.WeakSet[Source] = weakref.WeakSet()
        self.aborted = False

    def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` with this load as the current one (for its reads and the files it opens)."""
        context = contextvars.copy_context()
        context.run(_LOAD.set, self)
        return context.run(fn, *args)

    def overdue(self, timeout_s: float) -> Request | None:
        """The oldest read of this load in flight that began more than `timeout_s` seconds ago, if any."""
        now = time.monotonic()
        with _LOCK:
            late = [r for r in self.in_flight.values() if now - r.began > timeout_s]
        return min(late, key=lambda r: r.began, default=None)

    def abort(self) -> None:
        """Make every later read of this load fail at once: of the sources it opened (`Source.abort`: a read blocked
        in the kernel ends when the storage answers, or when its mount is aborted), and of those its caller opened
        (refused by `reading`, left usable for other loads). The threads of a load given up end instead of
        reading on."""
        with _LOCK:
            self.aborted = True
            sources = list(self.sources)
        for source in sources:
            source.abort()


#: The current load (`Load.run`); reads outside any load are kept in `_OUTSIDE`, which nobody watches or aborts.
_LOAD: contextvars.ContextVar[Load | None] = contextvars.ContextVar("raylazy_load", default=None)
_OUTSIDE = Load()
_LOCK = threading.Lock()
_KEYS = itertools.count()


@contextmanager
def requested(source: Source | str, what: str) -> Iterator[None]:
    """A storage request about `source` (an open Source, or the URI of one not open yet: opening it, listing its
    directory), kept in its load's requests in flight while it runs (`Load.overdue`); refused at once where the
    load was given up."""
    source = source if not isinstance(source, str) else _Unopened(source)
    load, key = _LOAD.get() or _OUTSIDE, next(_KEYS)
    with _LOCK:
        load.in_flight[key] = Request(time.monotonic(), source, what)
    try:
        check_given_up(source.uri)
        source.check_aborted()
        yield
    finally:
        with _LOCK:
            del load.in_flight[key]


def check_given_up(what: str) -> None:
    """Raise where the current load was given up (`Load.abort`): for a thread waiting on something other than
    storage (a keeper waiting for its node's stripes), which then stops too; `what`: the URI it waits for."""
    if (_LOAD.get() or _OUTSIDE).aborted:
        raise given_up(what)


class _Unopened(NamedTuple):
    """A file or directory a request is about before a Source of it is open (`requested`)."""

    uri: str
    kind: None = None

    def check_aborted(self) -> None:
        """Nothing opened: nothing to abort."""


@contextmanager
def reading(source: Source, what: str) -> Iterator[None]:
    """A read of `what` from `source`, kept in its load's reads in flight while it runs (`requested`), and a
    storage failure meanwhile (the Source contract: OSError, or EOFError for data that ends early) as the
    ReadError every reader raises, naming the file, the storage kind and what was being read."""
    try:
        with requested(source, what):
            yield
    except OSError as e:
        raise read_error(source, what, e.strerror or e) from None
    except EOFError as e:
        raise ReadError(f"{source.uri}{_on(source)}: file ended early {what}: {e}; it was truncated since planning") \
            from None


def read_error(source: Source, what: str, why) -> ReadError:
    """The ReadError of a read of `what` from `source` that failed for `why`: the file, the storage kind, what."""
    return ReadError(f"{source.uri}{_on(source)}: {what}: {why}")


def _on(source: Source) -> str:
    return f" (on {source.kind.name} storage)" if source.kind else ""


def stall_error(request: Request, timeout_s: float) -> StorageStallError:
    """The error of a load whose storage did not answer `request` within `timeout_s` seconds."""
    kind = request.source.kind.describe() if request.source.kind else "storage of an unknown kind"
    return StorageStallError(
        f"{request.source.uri}: {request.what}: no answer from the storage in {time.monotonic() - request.began:.1f} "
        f"s (request_timeout_s={timeout_s:g}; {kind}): the mount or the store stalled; nothing of this read was "
        "returned; load again once the storage answers, or raise request_timeout_s for storage this slow")
