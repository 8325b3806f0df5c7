"""Object storage (`s3://`, `gs://`, `az://`) through obstore: sources whose reads are HTTP range requests bound
to the object's ETag.

Why obstore (Python bindings of Rust's `object_store`, the client of Apache Arrow and DataFusion): one
well-kept client for S3 and S3-compatible stores, Google Cloud Storage and Azure Blob; credentials and
endpoint from the standard environment; retries with exponential backoff and jitter on throttling, 5xx,
connection errors and timeouts; conditional requests (`If-Match`); and it releases the GIL while a request
runs, so a rank's reader threads keep many requests in flight. boto3/s3fs would cover S3 alone, hold the GIL
while copying, and need their own retry and range plumbing.

Each bucket gets one client, configured from the environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ALLOW_HTTP=true` for a plain-http endpoint;
`GOOGLE_*` and `AZURE_*` likewise) and then from `storage_options`, which win. A storage option is one of:
obstore's store config (`endpoint`, `access_key_id`, `region`, ...), its client options (`allow_http`,
`timeout`, `connect_timeout`, ...: `_CLIENT_KEYS`), its retry settings (`max_retries`, default 10;
`retry_timeout`, default 180 s; `init_backoff`, `max_backoff` in seconds, default 0.1 and 15;
`backoff_base`, default 2), or raylazy's own: `part_bytes` (a range larger than this is fetched as parts,
concurrently; default 8 MiB) and `max_concurrency` (GETs in flight per process; default 32).

Throughput: a remote store serves each connection at tens of MB/s after tens of ms to first byte, so a rank
needs many requests in flight. A source's `concurrency` is `max_concurrency`: the ranged reader keeps that
many windows in flight (each a range in parts, or rows one GET each), and a semaphore holds the GETs of the
process to `max_concurrency`. Memory: parts stream straight into the destination buffers, so the bound is the
client's chunks, about `max_concurrency` x 1 MiB (on a GPU also the reader's staging windows, as for files).

Opening an object is one HEAD request (its size and ETag); every later GET of it carries `If-Match: <ETag>`,
so an object replaced while it is read is a `FileChangedError`, never a mix of two versions. A missing
bucket or object answers 404 at once (not retried): a clear error within one request.
"""

from __future__ import annotations

import errno
import threading
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from itertools import accumulate
from typing import Any

import obstore
from obstore.exceptions import NotFoundError, PermissionDeniedError, PreconditionError, UnauthenticatedError
from obstore.store import from_url

from ..errors import CheckpointNotFoundError, ConfigurationError, FileChangedError, StorageAccessError, first_line
from .base import NotAFileError, Source, Storage

#: Default `max_gap` for checkpoints in object storage: row gaps up to 1 MiB are read through. A request costs
#: about what 1 MiB of transfer costs (tens of ms to first byte against ~50-100 MB/s per connection; S3 also
#: bills requests and throttles them per prefix), and it is object_store's own coalescing distance. Row-split
#: tensors (gaps of a few KB) are then read whole, up to tp x their bytes: pass `max_gap=0` to fetch exactly
#: the needed bytes at one request per row.
DEFAULT_MAX_GAP = 1 << 20
DEFAULT_PART_BYTES = 8 << 20
DEFAULT_CONCURRENCY = 32
#: Bytes per chunk of a streamed response (a part is copied into place chunk by chunk).
_CHUNK_BYTES = 1 << 20

_CLIENT_KEYS = frozenset(
    "allow_http allow_invalid_certificates connect_timeout default_content_type default_headers http1_only "
    "http2_keep_alive_interval http2_keep_alive_timeout http2_keep_alive_while_idle http2_only pool_idle_timeout "
    "pool_max_idle_per_host proxy_url proxy_ca_certificate proxy_excludes root_certificate randomize_addresses "
    "read_timeout timeout user_agent".split()
)
_BACKOFF_KEYS = {"init_backoff": "init_backoff", "max_backoff": "max_backoff", "backoff_base": "base"}


class ObjectSource(Source):
    """One object version: range GETs (with If-Match on its ETag) into caller buffers; large ranges in parts."""

    def __init__(self, storage: ObjectStorage, store, key: str, uri: str, size: int, etag: str):
        self.storage, self.store, self.key = storage, store, key
        self.uri, self.size, self.version = uri, size, etag
        self.concurrency = storage.max_concurrency

    def _get(self, start: int, end: int):
        options: dict[str, Any] = {"range": (start, end)}
        if self.version:
            options["if_match"] = self.version
        return obstore.get(self.store, self.key, options=options)

    def read(self, offset: int, n: int) -> bytes:
        end = min(offset + n, self.size)
        if end <= offset:
            return b""
        try:
            with self.storage.slots:
                return bytes(self._get(offset, end).bytes())
        except Exception as e:  # noqa: BLE001  (obstore's errors: mapped to the Source contract)
            raise self._error(e) from None

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        ends = list(accumulate(len(v) for v in views))  # a gather is thousands of rows and gaps
        total = ends[-1] if ends else 0
        if offset + total > self.size:
            raise EOFError(f"{offset + total - self.size} bytes missing past the object's end ({self.size} bytes)")
        step = self.storage.part_bytes
        parts = [(a, min(a + step, offset + total)) for a in range(offset, offset + total, step)]
        if len(parts) == 1:
            self._fill(offset, *parts[0], views, ends)
            return
        for f in [self.storage.pool().submit(self._fill, offset, a, b, views, ends) for a, b in parts]:
            f.result()

    def _fill(self, base: int, start: int, end: int, views: list[memoryview], ends: list[int]) -> None:
        """GET bytes [start, end) and stream them into their place in `views` (which hold bytes from `base` on)."""
        targets = iter(_cut(views, ends, start - base, end - base))
        target, at = next(targets), 0
        try:
            with self.storage.slots:
                for chunk in self._get(start, end).stream(min_chunk_size=_CHUNK_BYTES):
                    data = memoryview(chunk)
                    while len(data):
                        if at == len(target):
                            target, at = next(targets), 0
                        n = min(len(data), len(target) - at)
                        target[at : at + n] = data[:n]
                        data, at = data[n:], at + n
        except StopIteration:
            raise OSError(errno.EIO, f"the server sent more than the {end - start} bytes asked for", self.uri) from None
        except Exception as e:  # noqa: BLE001
            raise self._error(e) from None
        if at < len(target) or next(targets, None) is not None:
            raise EOFError(f"the response for bytes {start}-{end} ended early")

    def _error(self, e: Exception) -> Exception:
        if isinstance(e, PreconditionError):
            return FileChangedError(f"{self.uri}: the object was replaced while being read (its ETag is no longer "
                                    f"{self.version}): plan again")
        return _os_error(e, self.uri)

    def close(self) -> None:
        pass


class ObjectStorage(Storage):
    """One object-storage scheme with one set of storage options; one client per bucket."""

    default_max_gap = DEFAULT_MAX_GAP

    def __init__(self, scheme: str, storage_options: Mapping[str, Any]):
        options = dict(storage_options)
        self.scheme = scheme
        try:
            self.part_bytes = int(options.pop("part_bytes", DEFAULT_PART_BYTES))
            self.max_concurrency = int(options.pop("max_concurrency", DEFAULT_CONCURRENCY))
            retry: dict[str, Any] = {}
            if "max_retries" in options:
                retry["max_retries"] = int(options.pop("max_retries"))
            if "retry_timeout" in options:
                retry["retry_timeout"] = timedelta(seconds=float(options.pop("retry_timeout")))
            backoff = {name: (float(options.pop(key)) if name == "base" else timedelta(seconds=float(options.pop(key))))
                       for key, name in _BACKOFF_KEYS.items() if key in options}
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"{scheme}:// storage_options: {e} (part_bytes, max_concurrency, max_retries: "
                                     "integers; retry_timeout, init_backoff, max_backoff: seconds)") from None
        if self.part_bytes < 1 or self.max_concurrency < 1:
            raise ConfigurationError(f"{scheme}:// storage_options: part_bytes and max_concurrency must be positive")
        if backoff:
            retry["backoff"] = backoff
        self._retry = retry or None
        self._client = {k: options.pop(k) for k in list(options) if k in _CLIENT_KEYS} or None
        self._config = options
        self._stores: dict[str, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        #: One per GET in flight (a part, a row, a header read): at most `max_concurrency` per process.
        self.slots = threading.BoundedSemaphore(self.max_concurrency)
        self._lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        """The threads that fetch the parts of large ranges (shared by this storage's sources)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="raylazy-part")
            return self._pool

    def _locate(self, uri: str) -> tuple[Any, str]:
        """(the bucket's client, the object key) of `uri`."""
        bucket, _, key = uri.partition("://")[2].partition("/")
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                try:
                    store = from_url(f"{self.scheme}://{bucket}", config=self._config or None,
                                     client_options=self._client, retry_config=self._retry)
                except Exception as e:  # noqa: BLE001  (an unknown key or a bad value)
                    raise ConfigurationError(f"{self.scheme}://{bucket}: cannot configure the object-store client: "
                                             f"{_first_line(e)}") from None
                self._stores[bucket] = store
        return store, key.strip("/")

    def open(self, uri: str) -> ObjectSource:
        store, key = self._locate(uri)
        if not key:
            raise NotAFileError(errno.EISDIR, "a bucket, not an object", uri)
        try:
            meta = obstore.head(store, key)
        except Exception as e:  # noqa: BLE001
            raise _os_error(e, uri) from None
        return ObjectSource(self, store, key, uri, meta["size"], meta.get("e_tag") or "")

    def _listing(self, uri: str) -> dict:
        store, key = self._locate(uri)
        try:
            return obstore.list_with_delimiter(store, key or None)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, (FileNotFoundError, NotFoundError)) or "NoSuchBucket" in str(e) or " 404 " in str(e):
                bucket = uri.partition("://")[2].partition("/")[0]
                raise CheckpointNotFoundError(f"{uri}: no such bucket {bucket!r} at this endpoint") from None
            raise _access_error(e, uri, "list") from None

    def list(self, uri: str) -> list[str]:
        listing = self._listing(uri)
        return [p.rstrip("/").rpartition("/")[2] for p in
                [o["path"] for o in listing["objects"]] + list(listing["common_prefixes"])]

    def exists(self, uri: str) -> bool:
        return self.is_file(uri) or self.is_dir(uri)

    def is_file(self, uri: str) -> bool:
        store, key = self._locate(uri)
        if not key:
            return False
        try:
            obstore.head(store, key)
        except (FileNotFoundError, NotFoundError):
            return False
        except Exception as e:  # noqa: BLE001
            raise _access_error(e, uri, "look up") from None
        return True

    def is_dir(self, uri: str) -> bool:
        listing = self._listing(uri)
        return bool(listing["objects"] or listing["common_prefixes"])

    def absolute(self, uri: str) -> str:
        return uri.rstrip("/")


def _cut(views: list[memoryview], ends: list[int], start: int, end: int) -> list[memoryview]:
    """The pieces of `views` (laid end to end, view i ending at `ends[i]`) that hold bytes [start, end)."""
    out = []
    for i in range(bisect_right(ends, start), len(views)):
        at = ends[i] - len(views[i])
        if at >= end:
            break
        lo, hi = max(start - at, 0), min(end - at, len(views[i]))
        if lo < hi:
            out.append(views[i][lo:hi])
    return out


def _first_line(e: Exception) -> str:
    return (first_line(e) or type(e).__name__)[:400]


def _os_error(e: Exception, uri: str) -> OSError:
    """An obstore failure as the OSError the Source contract promises, with the server's first line."""
    if isinstance(e, (FileNotFoundError, NotFoundError)):
        return FileNotFoundError(errno.ENOENT, "no such object (or no such bucket)", uri)
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError, PermissionError)):
        return PermissionError(errno.EACCES, f"access denied (check the credentials): {_first_line(e)}", uri)
    return OSError(errno.EIO, _first_line(e), uri)


def _access_error(e: Exception, uri: str, what: str) -> StorageAccessError:
    return StorageAccessError(f"{uri}: cannot {what} (after obstore's retries): {_os_error(e, uri).strerror}; "
                              "check the endpoint, credentials and network (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                              "... or storage_options)")
