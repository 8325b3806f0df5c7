"""What every reader shares: opening files checked against the plan, shard buffers (the caller's or new), statistics."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Mapping

from ..dtypes import itemsize, torch_dtype
from ..errors import BufferMismatchError, FileChangedError, ReadError
from ..header import MAX_HEADER_BYTES
from ..plans import FileRef, RankPlan, TensorShard
from ..storage import NotAFileError, Source, open_source

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
    #: Bytes received from peer ranks instead of storage (cooperative reads; 0 today).
    bytes_received: int = 0
    #: Bytes of shards copied from the rank with the same coordinates in a live replica (`raylazy.peers`),
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
    plan; read-ahead is off (the reader hints what it needs). The caller closes the returned source."""
    try:
        source = open_source(ref.uri, storage_options)
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


def shard_layout(shard: TensorShard) -> tuple[object, tuple[int, ...]]:
    """The torch dtype and shape a shard is returned as (sub-byte dtypes: uint8 rows, the last dim in bytes)."""
    if itemsize(shard.dtype) is None:
        rows = prod(shard.shape[:-1])
        shape = tuple(shard.shape[:-1]) + (shard.nbytes // rows,) if rows and shard.nbytes % rows == 0 else (shard.nbytes,)
        return torch_dtype(shard.dtype), shape
    return torch_dtype(shard.dtype), tuple(shard.shape)


def typed(flat, shard: TensorShard):
    """View a shard's flat uint8 buffer with its dtype and shape (sub-byte dtypes stay uint8 rows)."""
    dtype, shape = shard_layout(shard)
    return flat.view(dtype).reshape(shape)


def shard_buffers(torch, plan: RankPlan, dev, out: Mapping | None) -> list[tuple[object, object]]:
    """Per shard of `plan`: (its bytes as a flat uint8 tensor to fill, the tensor to return).

    A shard named in `out` is filled in place: the caller's tensor must have the shard's
    dtype and shape (`shard_layout`), be contiguous and on `dev`, else BufferMismatchError
    before anything is read. Other shards are allocated on `dev`. Padding (bytes no read
    covers) is zeroed either way.
    """
    out = dict(out or {})
    check_buffers(plan, dev, out)
    buffers = []
    for t in plan.tensors:
        padded = t.bytes_needed < t.nbytes
        given = out.get(t.name)
        if given is None:
            flat = (torch.zeros if padded else torch.empty)(t.nbytes, dtype=torch.uint8, device=dev)
            buffers.append((flat, typed(flat, t)))
            continue
        flat = given.detach().reshape(-1).view(torch.uint8)  # detached: a parameter may require grad
        if padded:
            flat.zero_()
        buffers.append((flat, given))
    return buffers


def check_buffers(plan: RankPlan, dev, out: Mapping) -> None:
    """BufferMismatchError unless every tensor of `out` is one of `plan`'s shards, with its dtype and shape,
    contiguous and on `dev` (a torch.device)."""
    unknown = sorted(set(out) - {t.name for t in plan.tensors})
    if unknown:
        raise BufferMismatchError(f"out names {len(unknown)} tensor(s) rank {plan.rank}'s plan does not hold, "
                                  f"e.g. {unknown[:3]}: pass only the plan's tensors")
    for t in plan.tensors:
        if t.name in out:
            _check_buffer(t, out[t.name], dev)


def _check_buffer(shard: TensorShard, given, dev) -> None:
    dtype, shape = shard_layout(shard)
    ok_device = given.device.type == dev.type and (dev.index is None or given.device.index == dev.index)
    if given.dtype != dtype or tuple(given.shape) != shape or not ok_device or not given.is_contiguous():
        state = "contiguous" if given.is_contiguous() else "not contiguous"
        raise BufferMismatchError(
            f"out[{shard.name!r}]: the shard ({shard.dtype} {list(shard.shape)}) needs a contiguous {dtype} "
            f"tensor of shape {list(shape)} on {dev}; given {given.dtype} {list(given.shape)}, {state}, on "
            f"{given.device}"
        )
