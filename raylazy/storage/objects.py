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
concurrently; default 8 MiB), `max_concurrency` (GETs in flight per process; default 32), and the cost model's
`request_latency` (seconds to a response's first byte), `connection_bandwidth` (bytes per second one
connection streams), `bandwidth` (bytes per second of all connections together; default: not limited) and
`request_rate` (GETs a second the store serves; default 5,500, S3's per prefix).

Throughput: a remote store serves each connection at tens of MB/s after tens of ms to first byte, so a rank
needs many requests in flight. A source's `concurrency` is `max_concurrency`: the ranged reader keeps that
many windows in flight (each a range in parts, or rows one GET each), and a semaphore holds the GETs of the
process to `max_concurrency`. Memory: parts stream straight into the destination buffers, so the bound is the
client's chunks, about `max_concurrency` x 1 MiB (on a GPU also the reader's staging windows, as for files).

Row-split tensors (rows a few KB apart) are read whole (fewer requests, up to tp x the bytes) or row by row (the
needed bytes, one request per row), per read, whichever the cost model (`raylazy.core.costs`) estimates sooner:
latency and per-connection bandwidth given as storage options, else measured on this storage's first GETs
(time to the first byte, and the rate of the body), else 30 ms and 100 MB/s.

Requests: opening an object is one GET of its first 64 KiB (`HEAD_BYTES`), whose response also gives the
object's size and ETag, so a safetensors header (or a small JSON file) costs that one request; a longer header
one more. Every later GET carries `If-Match: <ETag>`, so an object replaced while it is read is a
`FileChangedError`, never a mix of two versions; a planned object is therefore reopened without a request
(`ObjectStorage.reopen`: the plan's ETag is checked by every GET). A directory is one LIST. A missing bucket or
object answers 404 at once (not retried): a clear error within one request.
"""

from __future__ import annotations

import errno
import statistics
import threading
import time
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta
from itertools import accumulate
from typing import Any

import obstore
from obstore.exceptions import NotFoundError, PermissionDeniedError, PreconditionError, UnauthenticatedError
from obstore.store import from_url

from ..core.costs import CostModel
from ..core.kinds import StorageKind
from ..errors import CheckpointNotFoundError, ConfigurationError, FileChangedError, StorageAccessError, first_line
from .base import Listing, NotAFileError, Source, Storage

DEFAULT_PART_BYTES = 8 << 20
DEFAULT_CONCURRENCY = 32
#: Bytes of an object fetched by opening it: most safetensors headers, index and config files fit.
HEAD_BYTES = 64 << 10
#: The cost model's latency and per-connection bandwidth where neither is given nor measured (a cloud store).
DEFAULT_REQUEST_S = 0.03
DEFAULT_CONNECTION_BPS = 100e6
#: GETs a second one prefix of a bucket is served (S3's documented rate; it throttles above it).
DEFAULT_REQUEST_RATE = 5500.0
#: GETs whose timing the cost model is measured on (the first ones: discovery's).
_SAMPLES = 64
#: Bytes per chunk of a streamed response (a part is copied into place chunk by chunk).
_CHUNK_BYTES = 1 << 20

_CLIENT_KEYS = frozenset(
    "allow_http allow_invalid_certificates connect_timeout default_content_type default_headers http1_only "
    "http2_keep_alive_interval http2_keep_alive_timeout http2_keep_alive_while_idle http2_only pool_idle_timeout "
    "pool_max_idle_per_host proxy_url proxy_ca_certificate proxy_excludes root_certificate randomize_addresses "
    "read_timeout timeout user_agent".split()
)
_COST_KEYS = ("request_latency", "connection_bandwidth", "bandwidth", "request_rate")
_BACKOFF_KEYS = {"init_backoff": "init_backoff", "max_backoff": "max_backoff", "backoff_base": "base"}


class ObjectSource(Source):
    """One object version: range GETs (with If-Match on its ETag) into caller buffers; large ranges in parts."""

    def __init__(self, storage: ObjectStorage, store, key: str, uri: str, size: int, etag: str, head: bytes = b""):
        self.storage, self.store, self.key = storage, store, key
        self.uri, self.size, self.version = uri, size, etag
        self.concurrency = storage.max_concurrency
        self.kind = storage.kind(uri)
        #: The object's first bytes, fetched when it was opened (reads inside them cost no request).
        self.head = head

    def _get(self, start: int, end: int):
        self.check_aborted()
        options: dict[str, Any] = {"range": (start, end)}
        if self.version:
            options["if_match"] = self.version
        return obstore.get(self.store, self.key, options=options)

    def read(self, offset: int, n: int) -> bytes:
        end = min(offset + n, self.size)
        if end <= offset:
            return b""
        known = self.head[offset:end]
        if offset + len(known) == end:
            return known
        try:
            with self.storage.slots:
                return known + bytes(self._get(offset + len(known), end).bytes())
        except Exception as e:  # noqa: BLE001  (obstore's errors: mapped to the Source contract)
            raise self._error(e) from None

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        ends = list(accumulate(len(v) for v in views))  # a gather is thousands of rows and gaps
        total = ends[-1] if ends else 0
        if offset + total > self.size:
            raise EOFError(f"{offset + total - self.size} bytes missing past the object's end ({self.size} bytes)")
        if offset + total <= len(self.head):
            for view, end in zip(views, ends):
                view[:] = self.head[offset + end - len(view) : offset + end]
            return
        step = self.storage.part_bytes
        parts = [(a, min(a + step, offset + total)) for a in range(offset, offset + total, step)]
        stop = threading.Event()
        if len(parts) == 1:
            self._fill(offset, *parts[0], views, ends, stop)
            return
        # A failed part stops its siblings (those not started are cancelled, the running ones end at their next
        # chunk), and the error is raised only once none of them can write into the caller's buffers any more.
        failed: list[BaseException] = []

        def part(start: int, end: int) -> None:
            try:
                self._fill(offset, start, end, views, ends, stop)
            except BaseException as e:
                failed.append(e)
                stop.set()
                raise

        futures = [self.storage.pool().submit(part, a, b) for a, b in parts]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        wait(futures)
        if failed:
            raise failed[0]

    def _fill(self, base: int, start: int, end: int, views: list[memoryview], ends: list[int],
              stop: threading.Event) -> None:
        """GET bytes [start, end) and stream them into their place in `views` (which hold bytes from `base` on);
        return as soon as `stop` is set (a sibling part failed), writing nothing more."""
        targets = iter(_cut(views, ends, start - base, end - base))
        target, at = next(targets), 0
        try:
            with self.storage.slots:
                if stop.is_set():
                    return
                for chunk in self._get(start, end).stream(min_chunk_size=_CHUNK_BYTES):
                    if stop.is_set():
                        return
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
            return FileChangedError(f"{self.uri}: the object was replaced (its ETag is no longer {self.version}, the "
                                    "version planned or opened): plan again")
        return _os_error(e, self.uri)

    def close(self) -> None:
        pass


class ObjectStorage(Storage):
    """One object-storage scheme with one set of storage options; one client per bucket."""

    def __init__(self, scheme: str, storage_options: Mapping[str, Any]):
        options = dict(storage_options)
        self.scheme = scheme
        try:
            self.part_bytes = int(options.pop("part_bytes", DEFAULT_PART_BYTES))
            self.max_concurrency = int(options.pop("max_concurrency", DEFAULT_CONCURRENCY))
            self._given = {k: float(options.pop(k)) for k in _COST_KEYS if k in options}
            retry: dict[str, Any] = {}
            if "max_retries" in options:
                retry["max_retries"] = int(options.pop("max_retries"))
            if "retry_timeout" in options:
                retry["retry_timeout"] = timedelta(seconds=float(options.pop("retry_timeout")))
            backoff = {name: (float(options.pop(key)) if name == "base" else timedelta(seconds=float(options.pop(key))))
                       for key, name in _BACKOFF_KEYS.items() if key in options}
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"{scheme}:// storage_options: {e} (part_bytes, max_concurrency, max_retries: "
                                     "integers; retry_timeout, init_backoff, max_backoff, request_latency: seconds; "
                                     "connection_bandwidth, bandwidth: bytes per second; request_rate: GETs per "
                                     "second)") from None
        if self.part_bytes < 1 or self.max_concurrency < 1 or any(v <= 0 for v in self._given.values()):
            raise ConfigurationError(f"{scheme}:// storage_options: part_bytes, max_concurrency, request_latency, "
                                     "connection_bandwidth, bandwidth and request_rate must be positive")
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
        #: (seconds to the first byte, body bytes, seconds of the body) of the first GETs that opened objects.
        self._samples: list[tuple[float, int, float]] = []

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
        """One GET of the object's first HEAD_BYTES: its size and ETag come with them."""
        store, key = self._locate(uri)
        if not key:
            raise NotAFileError(errno.EISDIR, "a bucket, not an object", uri)
        try:
            with self.slots:
                t0 = time.perf_counter()
                result = obstore.get(store, key, options={"range": (0, HEAD_BYTES)})
                t1 = time.perf_counter()
                head = bytes(result.bytes())
                self._sample(t1 - t0, len(head), time.perf_counter() - t1)
            meta = result.meta
        except Exception as e:  # noqa: BLE001
            if " 416 " not in str(e):
                raise _os_error(e, uri) from None
            try:  # no range of an empty object exists: its HEAD says so
                meta, head = obstore.head(store, key), b""
            except Exception as e:  # noqa: BLE001
                raise _os_error(e, uri) from None
        return ObjectSource(self, store, key, uri, meta["size"], meta.get("e_tag") or "", head)

    def reopen(self, uri: str, size: int, version: str) -> ObjectSource | None:
        store, key = self._locate(uri)
        return ObjectSource(self, store, key, uri, size, version) if version and key else None

    def _sample(self, first_byte_s: float, nbytes: int, body_s: float) -> None:
        with self._lock:
            if len(self._samples) < _SAMPLES:
                self._samples.append((first_byte_s, nbytes, body_s))

    def kind(self, uri: str) -> StorageKind:
        """Object storage: every read a request over the network, no page cache."""
        return StorageKind(name="object", fs_type=self.scheme, network=True, page_cache=False)

    def cost_model(self, uri: str, kind: StorageKind | None = None) -> CostModel:
        """Latency and per-connection bandwidth as given, else as measured on the first GETs, else the defaults."""
        with self._lock:
            samples = list(self._samples)
        bodies = [(n, t) for _, n, t in samples if n >= HEAD_BYTES // 4]  # long enough to time
        moved = sum(t for _, t in bodies)
        return CostModel(
            request_s=self._given.get("request_latency")
            or (statistics.median(s[0] for s in samples) if samples else DEFAULT_REQUEST_S),
            connection_bps=self._given.get("connection_bandwidth")
            or (sum(n for n, _ in bodies) / moved if moved > 0 else DEFAULT_CONNECTION_BPS),
            concurrency=self.max_concurrency, part_bytes=self.part_bytes, bandwidth_bps=self._given.get("bandwidth", 0.0),
            request_rate=self._given.get("request_rate", DEFAULT_REQUEST_RATE))

    def _listing(self, uri: str) -> dict:
        store, key = self._locate(uri)
        try:
            return obstore.list_with_delimiter(store, key or None)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, (FileNotFoundError, NotFoundError)) or "NoSuchBucket" in str(e) or " 404 " in str(e):
                bucket = uri.partition("://")[2].partition("/")[0]
                raise CheckpointNotFoundError(f"{uri}: no such bucket {bucket!r} at this endpoint") from None
            raise _access_error(e, uri, "list") from None

    def listing(self, uri: str) -> Listing | None:
        """One LIST: the objects directly under `uri` (files) and the prefixes below it (directories)."""
        listing = self._listing(uri)
        files = {o["path"].rpartition("/")[2] for o in listing["objects"]} - {""}  # "" : a directory marker
        names = files | {p.rstrip("/").rpartition("/")[2] for p in listing["common_prefixes"]}
        return Listing(frozenset(names), frozenset(files)) if names else None

    def list(self, uri: str) -> list[str]:
        listing = self.listing(uri)
        return sorted(listing.names) if listing else []

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
        return self.listing(uri) is not None

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
