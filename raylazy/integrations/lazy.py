"""Checkpoint tensors as lazy, tensor-like weights whose use says which bytes to read, and the reads that serve them.

A consumer (vLLM's `model.load_weights`, with its own weight loaders) gets one `LazyWeight` per checkpoint
tensor. It runs twice. While `Recording`, nothing is read: `narrow`, basic slicing, `chunk` and `split` only
shrink the weight's `Region` (a box of the full tensor), and `param.copy_(weight)` notes the region and
copies nothing; any other use (`.t()`, `.item()`, `torch.cat`, ...) notes the region as it is at that point,
marked *opaque* (raylazy cannot follow the op, so it reads all of it), and gets zeros. While `Serving`, the
noted regions are read in batches of about `batch_bytes`, in the order they were noted, by a raylazy reader
on a background thread (at most `batches_ahead` batches beyond the ones being taken), and each use gets the region's
real bytes. A region the second run takes that the first did not note is read on its own and counted.

Each region becomes one `TensorShard` of a one-rank plan, cut along its first narrowed dim exactly as the
planner cuts a placement's slice (one range, or one range per row); a region narrowed along several dims is
read along the first and cut down in memory (the extra bytes count as read, not needed).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import ceil, prod

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..core.checkpoint import Checkpoint
from ..core.dtypes import DTYPE_BITS, torch_dtype
from ..core.header import TensorInfo
from ..core.mesh import Mesh
from ..core.options import ReaderOptions, validated
from ..core.placements import Piece, Slicing
from ..core.planner import tensor_shard
from ..core.plans import FileRef, RankPlan, TensorShard
from ..errors import ConfigurationError
from ..io.backends import NODE_BACKENDS, read_rank, solo_backend
from ..io.stats import ReadStats

#: Default bytes of regions read per batch.
DEFAULT_BATCH_BYTES = 256 << 20


class LazyOptions(BaseModel):
    """How lazy weights are served: the reader (`ReaderOptions`: backend ranged or fastsafetensors, threads,
    queue_size, chunk_bytes, ...), row gaps read through (`max_gap`, as for `raylazy.plan`), and the batches:
    about `batch_bytes` of regions each (ranged; fastsafetensors reads all in one), `batches_ahead` read
    beyond the ones being used (host memory: about (batches_ahead + 2) x batch_bytes)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    reader: ReaderOptions = ReaderOptions()
    max_gap: int = Field(0, ge=0)
    batch_bytes: int = Field(DEFAULT_BATCH_BYTES, ge=4096)
    batches_ahead: int = Field(1, ge=0, le=64)

    @property
    def backend(self) -> str:
        return solo_backend(self.reader.backend)


def lazy_options(options: Mapping | None) -> LazyOptions:
    """Validate flat options (the reader's and LazyOptions' own): a ConfigurationError names each bad or unknown one."""
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"options must be a mapping of option names to values, got {type(options).__name__}")
    if options.get("backend") in NODE_BACKENDS:
        raise ConfigurationError(f"backend={options['backend']!r}: lazy weights cannot read cooperatively yet (no "
                                 "process group is shared with the other ranks here); use 'ranged' or 'fastsafetensors'")
    reader = {k: v for k, v in options.items() if k in ReaderOptions.model_fields}
    rest = {k: v for k, v in options.items() if k not in reader}
    return validated(LazyOptions, **rest, reader=validated(ReaderOptions, **reader))


@dataclass(frozen=True)
class Region:
    """The box `starts` .. `starts + sizes` of tensor `tensor` (in checkpoint file `file`)."""

    file: int
    tensor: TensorInfo
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def whole(cls, file: int, tensor: TensorInfo) -> Region:
        return cls(file, tensor, (0,) * len(tensor.shape), tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return prod(self.sizes) * DTYPE_BITS[self.tensor.dtype] // 8

    @property
    def cut_dims(self) -> tuple[int, ...]:
        return tuple(d for d, (n, full) in enumerate(zip(self.sizes, self.tensor.shape)) if n != full)

    def narrow(self, dim: int, start: int, length: int) -> Region:
        """The region of `torch.narrow(self, dim, start, length)` (its errors, too)."""
        ndim = len(self.sizes)
        if not -ndim <= dim < ndim:
            raise IndexError(f"{self.tensor.name}: dimension {dim} out of range for a {ndim}-d tensor")
        dim %= ndim
        size = self.sizes[dim]
        start = start + size if start < 0 else start
        if start < 0 or length < 0 or start + length > size:
            raise RuntimeError(f"{self.tensor.name}: narrow(dim={dim}, start={start}, length={length}) is out of "
                               f"range for size {size}")
        return Region(self.file, self.tensor, _put(self.starts, dim, self.starts[dim] + start),
                      _put(self.sizes, dim, length))

    def shard(self, max_gap: int, path: str) -> TensorShard:
        """The plan entry reading this region along its first narrowed dim (the whole tensor if none)."""
        cut = self.cut_dims
        slicing = None
        if cut:
            d = cut[0]
            slicing = Slicing(d, self.sizes[d], (Piece(self.starts[d], 0, self.sizes[d]),))
        return tensor_shard(self.file, self.tensor, "lazy", slicing, max_gap, path)

    def trim(self, tensor):
        """`tensor`, read along the first narrowed dim, cut down along the others."""
        for d in self.cut_dims[1:]:
            tensor = tensor.narrow(d, self.starts[d], self.sizes[d])
        return tensor


def _put(values: tuple[int, ...], i: int, v: int) -> tuple[int, ...]:
    return values[:i] + (v,) + values[i + 1 :]


def lazy_weights(ckpt: Checkpoint, run: Recording | Serving) -> Iterator[tuple[str, LazyWeight]]:
    """(name, LazyWeight) for every tensor of the checkpoint, in file order."""
    for fi, t in ckpt.tensors():
        yield t.name, LazyWeight(run, Region.whole(fi, t))


class LazyWeight:
    """A checkpoint tensor that reads nothing until used; narrowing and slicing only shrink its region. Like a
    tensor, it takes attributes of the consumer's own (vLLM tags weights with a `shard_id`)."""

    def __init__(self, run: Recording | Serving, region: Region):
        self.run, self.region = run, region

    def __repr__(self) -> str:
        return f"LazyWeight({self.region.tensor.name!r}, starts={self.region.starts}, sizes={self.region.sizes})"

    # what a weight loader asks without needing the data
    @property
    def shape(self):
        return torch.Size(self.region.sizes)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def ndim(self) -> int:
        return len(self.region.sizes)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return prod(self.region.sizes)

    def __len__(self) -> int:
        return self.region.sizes[0]

    @property
    def dtype(self):
        return torch_dtype(self.region.tensor.dtype)

    @property
    def device(self):
        return torch.device("cpu")

    def element_size(self) -> int:
        return DTYPE_BITS[self.region.tensor.dtype] // 8

    # what only shrinks the region (or keeps it)
    def detach(self) -> LazyWeight:
        return LazyWeight(self.run, self.region)

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        return LazyWeight(self.run, self.region.narrow(dim, start, length))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyWeight, ...]:
        n = self.region.sizes[dim]
        return self.split(ceil(n / chunks) if n else 1, dim)

    def split(self, split_size, dim: int = 0) -> tuple[LazyWeight, ...]:
        n = self.region.sizes[dim]
        sizes = list(split_size) if isinstance(split_size, (list, tuple)) else \
            [min(split_size, n - s) for s in range(0, n, split_size)] or [0]
        if sum(sizes) != n:
            raise RuntimeError(f"{self.region.tensor.name}: split sizes {sizes} do not sum to {n} along dim {dim}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, s, k) for s, k in zip(starts, sizes))

    def __getitem__(self, key):
        """Slices with step 1 (and `...`) narrow; anything else reads the region and indexes it."""
        keys = key if isinstance(key, tuple) else (key,)
        if all(k is Ellipsis or (isinstance(k, slice) and k.step in (None, 1)) for k in keys) and \
                sum(k is Ellipsis for k in keys) <= 1:
            dims = list(range(self.ndim))
            if Ellipsis in keys:
                at = keys.index(Ellipsis)
                dims = dims[:at] + dims[len(dims) - (len(keys) - at - 1):]
                keys = keys[:at] + keys[at + 1:]
            if len(keys) > self.ndim:
                raise IndexError(f"{self.region.tensor.name}: too many indices ({len(keys)}) for a {self.ndim}-d tensor")
            out = self
            for d, k in zip(dims, keys):
                start, stop, _ = k.indices(out.region.sizes[d])
                out = out.narrow(d, start, max(0, stop - start))
            return out
        return self.materialize()[key]

    # what needs the data
    def materialize(self):
        """The region as a tensor (an op raylazy cannot follow: the whole current region is read)."""
        return self.run.take(self.region, opaque=True)

    def __getattr__(self, name: str):
        """Any other tensor attribute reads the region; a name tensors lack is an AttributeError (reading nothing)."""
        if name.startswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], LazyWeight) and func in _SHRINKING:
            return getattr(args[0], _SHRINKING[func])(*args[1:], **kwargs)
        if func is torch.Tensor.copy_ and len(args) == 2 and isinstance(args[1], LazyWeight) \
                and not isinstance(args[0], LazyWeight):
            return args[1].run.copy_into(args[0], args[1].region)
        return func(*_materialized(args), **_materialized(kwargs))


def _materialized(value):
    if isinstance(value, LazyWeight):
        return value.materialize()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialized(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialized(v) for k, v in value.items()}
    return value


#: torch functions that only shrink a LazyWeight's region, and the LazyWeight method doing it.
_SHRINKING = {torch.narrow: "narrow", torch.Tensor.narrow: "narrow", torch.chunk: "chunk",
              torch.Tensor.chunk: "chunk", torch.split: "split", torch.Tensor.split: "split"}


def _operator(name: str):
    def op(self, *args):
        return getattr(self.materialize(), name)(*_materialized(args))

    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__neg__",
              "__float__", "__int__", "__array__"):
    setattr(LazyWeight, _name, _operator(_name))


@dataclass
class LazyStats:
    """What serving the regions took from storage. `bytes_needed`: the regions' own bytes (each distinct region
    once); `opaque_*`: regions taken by an op raylazy cannot follow, read as far as they were narrowed (all of
    the tensor when not narrowed at all); `unplanned_*`: regions the second run took that the first did not."""

    regions: int = 0
    bytes_needed: int = 0
    bytes_read: int = 0
    requests: int = 0
    batches: int = 0
    read_seconds: float = 0.0
    opaque_regions: int = 0
    opaque_bytes: int = 0
    whole_opaque: int = 0
    unplanned_regions: int = 0
    unplanned_bytes: int = 0

    def add_read(self, stats: ReadStats) -> None:
        self.bytes_read += stats.bytes_read
        self.requests += stats.requests
        self.read_seconds += stats.seconds
        self.batches += 1


class Recording:
    """The first run: notes every region taken (in order, with the number of takes); reads nothing."""

    def __init__(self):
        self.takes: dict[Region, int] = {}
        self.opaque: set[Region] = set()

    def _note(self, region: Region, opaque: bool) -> None:
        self.takes[region] = self.takes.get(region, 0) + 1
        if opaque:
            self.opaque.add(region)

    def take(self, region: Region, opaque: bool):
        self._note(region, opaque)
        return torch.zeros(region.sizes, dtype=torch_dtype(region.tensor.dtype))

    def copy_into(self, dst, region: Region):
        self._note(region, False)
        return dst


@dataclass
class _Batch:
    regions: list[Region]
    left: int  # regions of the batch not yet taken their last time
    read: bool = False


class Serving:
    """The second run: reads the recorded regions in batches on a background thread and hands them out.

    Batches follow the recording order, each at most `batch_bytes` (or one region; fastsafetensors: all in
    one) and holding each tensor once (a reader's shards are named by tensor). The reader stays at most
    `batches_ahead` batches beyond the ones not yet fully taken, unless a take waits for a later batch. Use as
    a context manager: leaving it stops the reader."""

    def __init__(self, recording: Recording, files: tuple[FileRef, ...], options: LazyOptions = LazyOptions(),
                 device: str = "cpu"):
        self._files, self._options, self._device = files, options, device
        batch_bytes = options.batch_bytes if options.backend == "ranged" else float("inf")
        self._left = dict(recording.takes)
        self.stats = LazyStats(regions=len(self._left), bytes_needed=sum(r.nbytes for r in self._left),
                               opaque_regions=len(recording.opaque),
                               opaque_bytes=sum(r.nbytes for r in recording.opaque),
                               whole_opaque=sum(not r.cut_dims for r in recording.opaque))
        self._batches: list[_Batch] = []
        self._batch_of: dict[Region, int] = {}
        names: set[str] = set()
        size = 0
        for region in self._left:
            if not self._batches or size + region.nbytes > batch_bytes and size or region.tensor.name in names:
                self._batches.append(_Batch([], 0))
                names, size = set(), 0
            self._batches[-1].regions.append(region)
            self._batches[-1].left += 1
            self._batch_of[region] = len(self._batches) - 1
            names.add(region.tensor.name)
            size += region.nbytes
        self._ready: dict[Region, object] = {}
        self._wanted = -1  # the latest batch a take waits for
        self._taken = 0  # batches fully taken
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="raylazy-lazy-reader", daemon=True)

    def __enter__(self) -> Serving:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _plan(self, regions: list[Region]) -> RankPlan:
        shards = tuple(r.shard(self._options.max_gap, self._files[r.file].uri) for r in regions)
        return RankPlan(rank=0, mesh=Mesh(), files=self._files, tensors=shards)

    def _read_regions(self, regions: list[Region]) -> dict[Region, object]:
        tensors, stats = read_rank(self._plan(regions), self._device, options=self._options.reader)
        with self._cond:  # the reader thread and an unplanned take may both count
            self.stats.add_read(stats)
        return {r: r.trim(tensors[r.tensor.name]) for r in regions}

    def _run(self) -> None:
        try:
            for b, batch in enumerate(self._batches):
                with self._cond:
                    while not self._stop and b > self._wanted and b - self._taken > self._options.batches_ahead:
                        self._cond.wait()
                    if self._stop:
                        return
                got = self._read_regions(batch.regions)
                with self._cond:
                    self._ready.update(got)
                    batch.read = True
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001  (handed to the take that waits: the load fails there, with it)
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def take(self, region: Region, opaque: bool = False):
        """The region's bytes as a tensor (waits for its batch); a region not recorded is read on its own."""
        with self._cond:
            if self._left.get(region):
                return self._take_recorded(region)
        self.stats.unplanned_regions += 1
        self.stats.unplanned_bytes += region.nbytes
        return self._read_regions([region])[region]

    def _take_recorded(self, region: Region):
        """A recorded region with takes left (called holding the lock): waits for its batch, frees it on its last take."""
        b = self._batch_of[region]
        self._wanted = max(self._wanted, b)
        self._cond.notify_all()
        while not self._batches[b].read and self._error is None:
            self._cond.wait()
        if self._error is not None:
            raise self._error
        self._left[region] -= 1
        if self._left[region]:
            return self._ready[region]
        self._batches[b].left -= 1
        if not self._batches[b].left:
            self._taken += 1
            self._cond.notify_all()
        return self._ready.pop(region)

    def copy_into(self, dst, region: Region):
        return dst.copy_(self.take(region))

