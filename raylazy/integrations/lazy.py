"""Checkpoint tensors as lazy, tensor-like weights whose use says which bytes to read.

A consumer (vLLM's `model.load_weights`, with its own weight loaders) gets one `LazyWeight` per checkpoint tensor.
What only rearranges a tensor reads nothing: `narrow`, `select`, basic indexing, `chunk`, `split`, `unbind`,
`unsqueeze`, `squeeze`, `transpose`, `t`, `permute`, `reshape` or `view` that only add or drop dims of size 1,
`contiguous`, and `to`/`float`/... (applied when the bytes come, each conversion in turn). Such a weight is its
`Region` (a box of the full tensor, `raylazy.core.boxes`) seen through a `Lens` (which box dim each of its dims
shows, and its conversions). `dst.copy_(weight)` and `dst[index] = weight` are copies its run defers
(`raylazy.integrations.recording`); any other use (`.item()`, arithmetic, `torch.cat`, an in-place op, ...) reads
the weight's region, as far as it was narrowed, there and then (counted as opaque): the weight is that tensor. Weights that would be views of one tensor in eager torch share a
`_Memory`: one changed in place makes a use of another where they meet a `LazyWeightError`, never stale bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from math import ceil, prod

import torch
from torch.utils._pytree import tree_map

from ..core.boxes import Region
from ..core.checkpoint import Checkpoint
from ..core.dtypes import torch_dtype
from ..errors import LazyWeightError


@dataclass(frozen=True)
class Lens:
    """How a lazy weight shows its region's box: its dim i is box dim `dims[i]` (None: a dim of size 1 it
    added); box dims it does not show have size 1. `dtypes`: the conversions asked, in turn (each one rounds as
    torch's own would: a chain is not one conversion); `device`: the device asked (None: none)."""

    dims: tuple[int | None, ...]
    dtypes: tuple[torch.dtype, ...] = ()
    device: torch.device | None = None

    def of(self, box: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """The weight's tensor from its box as read (`sizes`: the region's; a sub-byte dtype, read as uint8
        bytes, is returned as read)."""
        t = self.converted(self.shown(box, sizes), None)
        return t if self.device is None else t.to(self.device)

    def converted(self, t: torch.Tensor, into: torch.dtype | None) -> torch.Tensor:
        """`t` through the conversions asked, the last left to a copy into a tensor of dtype `into` (which makes
        it as it copies)."""
        dtypes = self.dtypes[:-1] if self.dtypes[-1:] == (into,) else self.dtypes
        for dtype in dtypes:
            t = t.to(dtype)
        return t

    def shown(self, box: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """The box in the weight's shape, in the box's dtype and device."""
        if self.dims == tuple(range(len(sizes))) or tuple(box.shape) != sizes:
            return box
        kept = [d for d in self.dims if d is not None]
        t = box.permute(kept + [d for d in range(box.ndim) if d not in kept])
        return t.reshape([box.shape[d] if d is not None else 1 for d in self.dims])

    @property
    def in_order(self) -> bool:
        """Whether the lens shows the box's bytes in their own order (dims of size 1 added or dropped aside)."""
        kept = [d for d in self.dims if d is not None]
        return kept == sorted(kept)


def lazy_weights(ckpt: Checkpoint, run) -> Iterator[tuple[str, LazyWeight]]:
    """(name, LazyWeight) for every tensor of the checkpoint, in file order; `run` (a `Recording`, or `Served`: a
    serving of their regions) takes their bytes and copies."""
    for fi, t in ckpt.tensors():
        yield t.name, LazyWeight(run, Region.whole(fi, t), Lens(tuple(range(len(t.shape)))), _Memory())


class _Memory:
    """What the lazy weights that would be views of one tensor in eager torch share, as such views share its
    memory: the tensors read for those of them an op raylazy cannot follow took, each with its region and its
    version counter then. A weight still lazy whose region meets one of them that was written since (an in-place
    op) would read what eager torch's view would not show: `check` makes that an error, never a silent
    difference. A copy (`clone`, a conversion) has memory of its own."""

    def __init__(self):
        self.read: list[tuple[Region, torch.Tensor, int]] = []

    def add(self, region: Region, t: torch.Tensor) -> None:
        if not t.is_inference():  # an inference tensor counts no versions (vLLM loads outside inference mode)
            self.read.append((region, t, t._version))

    def check(self, region: Region) -> None:
        for r, t, version in self.read:
            if t._version != version and all(a < b + m and b < a + n for a, n, b, m in
                                             zip(r.starts, r.sizes, region.starts, region.sizes)):
                raise LazyWeightError(
                    f"{region.tensor.name}: the weight loader changed this checkpoint tensor in place (through a "
                    f"view of {list(r.sizes)} at {list(r.starts)}) and then used another view of it, which would "
                    "show the change in eager torch; raylazy's lazy weights cannot: load this model with vLLM's "
                    "default format, or have its loader clone() a weight before changing it")


def _follows(method: Callable) -> Callable:
    """A tensor method a LazyWeight follows without reading; once the weight was read, the tensor's own."""
    name = method.__name__

    @functools.wraps(method)
    def op(self, *args, **kwargs):
        if self._data is not None:
            return getattr(self._data, name)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return op


class LazyWeight:
    """A checkpoint tensor that reads nothing until used; rearranging it only changes its region and lens. Like
    a tensor, it takes attributes of the consumer's own (vLLM tags weights with a `shard_id`)."""

    def __init__(self, run, region: Region, lens: Lens, memory: _Memory):
        self.run, self.region, self.lens, self.memory = run, region, lens, memory
        self._data = None  # the tensor, once an op that cannot be followed read it

    def __repr__(self) -> str:
        return f"LazyWeight({self.region.tensor.name!r}, starts={self.region.starts}, sizes={self.region.sizes})"

    def _with(self, region: Region | None = None, dims: tuple | None = None, copy: bool = False,
              **conversion) -> LazyWeight:
        """The weight as another view (`copy`: a copy, in memory of its own), its region, dims or conversions
        changed."""
        self.memory.check(self.region)
        lens = Lens(self.lens.dims if dims is None else dims, conversion.get("dtypes", self.lens.dtypes),
                    conversion.get("device", self.lens.device))
        return LazyWeight(self.run, region or self.region, lens, _Memory() if copy else self.memory)

    def _dim(self, dim: int, extra: int = 0) -> int:
        n = self.ndim + extra
        if not -n <= dim < n:
            raise IndexError(f"{self.region.tensor.name}: dimension {dim} out of range for a {self.ndim}-d tensor")
        return dim % n

    # what a consumer asks without needing the data
    @property
    def shape(self) -> torch.Size:
        if self._data is not None:
            return self._data.shape
        return torch.Size(self.region.sizes[d] if d is not None else 1 for d in self.lens.dims)

    def __len__(self) -> int:
        return self.shape[0]

    # asked on every narrow, select and reshape: answered here, not by a meta tensor (`__getattr__`)
    @property
    def ndim(self) -> int:
        return self._data.ndim if self._data is not None else len(self.lens.dims)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self._data.numel() if self._data is not None else prod(self.shape)

    @property
    def dtype(self) -> torch.dtype:
        if self._data is not None:
            return self._data.dtype
        return self.lens.dtypes[-1] if self.lens.dtypes else torch_dtype(self.region.tensor.dtype)

    @property
    def device(self) -> torch.device:
        if self._data is not None:
            return self._data.device
        return self.lens.device or torch.device("cpu")

    # what only changes the region or the lens (`lens`, not `view`: a weight follows torch's view())
    @_follows
    def detach(self) -> LazyWeight:
        return self._with()

    @_follows
    def contiguous(self, memory_format=torch.contiguous_format) -> LazyWeight:
        return self._with()

    @_follows
    def clone(self, memory_format=torch.preserve_format) -> LazyWeight:
        return self._with(copy=True)

    @_follows
    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        dim = self._dim(dim)
        box = self.lens.dims[dim]
        if box is not None:
            return self._with(self.region.narrow(box, start, length))
        if start in (0, -1) and length == 1:
            return self
        if length == 0 and start in (0, 1):  # empty: not a byte to read (eager torch's is an empty view)
            return torch.empty(self.shape[:dim] + (0,) + self.shape[dim + 1 :], dtype=self.dtype, device=self.device)
        raise RuntimeError(f"{self.region.tensor.name}: narrow(dim={dim}, start={start}, length={length}) is out of "
                           "range for size 1")

    @_follows
    def select(self, dim: int, index: int) -> LazyWeight:
        dim = self._dim(dim)
        n = self.shape[dim]
        if not -n <= index < n:
            raise IndexError(f"{self.region.tensor.name}: index {index} is out of bounds for dimension {dim} "
                             f"with size {n}")
        out = self.narrow(dim, index % n, 1)
        return out._with(dims=out.lens.dims[:dim] + out.lens.dims[dim + 1 :])

    @_follows
    def unbind(self, dim: int = 0) -> tuple[LazyWeight, ...]:
        return tuple(self.select(dim, i) for i in range(self.shape[self._dim(dim)]))

    @_follows
    def unsqueeze(self, dim: int) -> LazyWeight:
        dim = self._dim(dim, extra=1)
        return self._with(dims=self.lens.dims[:dim] + (None,) + self.lens.dims[dim:])

    @_follows
    def squeeze(self, dim=None) -> LazyWeight:
        dims = range(self.ndim) if dim is None else [self._dim(d) for d in (dim if isinstance(dim, (tuple, list))
                                                                           else (dim,))]
        drop = {d for d in dims if self.shape[d] == 1}
        return self._with(dims=tuple(b for i, b in enumerate(self.lens.dims) if i not in drop))

    @_follows
    def permute(self, *dims) -> LazyWeight:
        dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
        order = [self._dim(d) for d in dims]
        if sorted(order) != list(range(self.ndim)):
            raise RuntimeError(f"{self.region.tensor.name}: permute({list(dims)}) is not a permutation of "
                               f"{self.ndim} dims")
        return self._with(dims=tuple(self.lens.dims[d] for d in order))

    @_follows
    def transpose(self, dim0: int, dim1: int) -> LazyWeight:
        order = list(range(self.ndim))
        a, b = self._dim(dim0), self._dim(dim1)
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    swapaxes = swapdims = transpose

    @_follows
    def t(self) -> LazyWeight:
        if self.ndim > 2:
            raise RuntimeError(f"{self.region.tensor.name}: t() expects a tensor with <= 2 dimensions, but it has "
                               f"{self.ndim}")
        return self.transpose(0, 1) if self.ndim == 2 else self

    @property
    def T(self) -> LazyWeight:  # noqa: N802  (torch's name)
        return self._data.T if self._data is not None else self.permute(list(reversed(range(self.ndim))))

    @_follows
    def reshape(self, *shape) -> LazyWeight:
        """Followed where it only adds or drops dims of size 1; any other reshape reads the region."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        if shape.count(-1) == 1 and self.numel():
            known = prod(s for s in shape if s != -1)
            shape = tuple(self.numel() // known if s == -1 else s for s in shape)
        mine = [(i, n) for i, n in enumerate(self.shape) if n != 1]
        if prod(shape) != self.numel() or [n for n in shape if n != 1] != [n for _, n in mine]:
            return self.materialize().reshape(shape)
        it = iter(mine)
        return self._with(dims=tuple(None if n == 1 else self.lens.dims[next(it)[0]] for n in shape))

    @_follows
    def view(self, *shape, dtype: torch.dtype | None = None):
        if dtype is not None or len(shape) == 1 and isinstance(shape[0], torch.dtype):
            return self.materialize().view(dtype or shape[0])
        return self.reshape(*shape)

    @_follows
    def to(self, *args, **kwargs):
        """A conversion (to another dtype or device: a copy, as torch makes one) or, to what it is, the weight."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)  # how torch itself reads to()'s arguments
        dtypes = self.lens.dtypes + ((dtype,) if dtype is not None and dtype != self.dtype else ())
        device = torch.device(device) if device is not None else None
        if dtypes == self.lens.dtypes and device in (None, self.device):
            return self
        return self._with(copy=True, dtypes=dtypes, device=device or self.lens.device)

    @_follows
    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyWeight, ...]:
        n = self.shape[self._dim(dim)]
        return self.split(ceil(n / chunks) if n else 1, dim)

    @_follows
    def split(self, split_size, dim: int = 0) -> tuple[LazyWeight, ...]:
        n = self.shape[self._dim(dim)]
        sizes = list(split_size) if isinstance(split_size, (list, tuple)) else \
            [min(split_size, n - s) for s in range(0, n, split_size)] or [0]
        if sum(sizes) != n:
            raise RuntimeError(f"{self.region.tensor.name}: split sizes {sizes} do not sum to {n} along dim {dim}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, s, k) for s, k in zip(starts, sizes))

    def __getitem__(self, key):
        """Ints select, slices with step 1 narrow, None adds a dim, `...` fills; anything else reads the region."""
        if self._data is not None or not _basic(key):
            return self.materialize()[key]
        keys = key if isinstance(key, tuple) else (key,)
        taking = sum(k is not None and k is not Ellipsis for k in keys)
        if taking > self.ndim:
            raise IndexError(f"{self.region.tensor.name}: too many indices ({taking}) for a {self.ndim}-d tensor")
        if Ellipsis in keys:
            at = keys.index(Ellipsis)
            keys = keys[:at] + (slice(None),) * (self.ndim - taking) + keys[at + 1 :]
        out, d = self, 0
        for k in keys:
            if k is None:
                out, d = out.unsqueeze(d), d + 1
            elif isinstance(k, slice):
                start, stop, _ = k.indices(out.shape[d])
                out, d = out.narrow(d, start, max(0, stop - start)), d + 1
            else:
                out = out.select(d, k)
        return out

    # what needs the data
    def materialize(self) -> torch.Tensor:
        """The weight as a tensor (for an op raylazy cannot follow: its region is read as far as narrowed)."""
        if self._data is None:
            self.memory.check(self.region)
            self._data = self.lens.of(self.run.take(self.region), self.region.sizes)
            self.memory.add(self.region, self._data)
        return self._data

    def __getattr__(self, name: str):
        """What only the shape and dtype say (`size()`, `element_size()`, ...) is a meta tensor's answer; any other tensor
        attribute reads the region; a name tensors lack is an AttributeError (reading nothing)."""
        if name.startswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name in _SHAPE_ONLY and self._data is None:
            return getattr(torch.empty(self.shape, dtype=self.dtype, device="meta"), name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], LazyWeight) and func in _FOLLOWED:
            return getattr(args[0], _FOLLOWED[func])(*args[1:], **kwargs)
        if deferred(func, args):
            weight = args[-1]
            weight.memory.check(weight.region)
            if func is torch.Tensor.copy_:
                return weight.run.copy_into(args[0], weight)
            # torch's `dst[index] = value` drops the value's leading dims of size 1 before it copies
            ones = next((i for i, n in enumerate(weight.shape) if n != 1), weight.ndim)
            weight.run.copy_into(args[0][args[1]], weight._with(dims=weight.lens.dims[ones:]))
            return None
        return func(*_materialized(args), **_materialized(kwargs))


def deferred(func, args) -> bool:
    """Whether torch function `func` on `args` is a copy of a lazy weight, not yet read, into a tensor:
    `dst.copy_(weight)` or `dst[index] = weight` (an index that narrows or selects), which a run defers."""
    if func is torch.Tensor.copy_:
        return len(args) == 2 and isinstance(args[0], torch.Tensor) and _lazy(args[1])
    return func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[0], torch.Tensor) and \
        _lazy(args[2]) and _basic(args[1])


def _lazy(value) -> bool:
    return isinstance(value, LazyWeight) and value._data is None


def _basic(key) -> bool:
    """Whether an index is basic (ints, slices with step 1, None, `...`): it narrows, selects or adds dims."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or type(k) is int or isinstance(k, slice) and k.step in (None, 1)
               for k in keys) and sum(k is Ellipsis for k in keys) <= 1


def _materialized(value):
    """`value` with every lazy weight in it (in lists, tuples and dicts too) read."""
    return tree_map(lambda v: v.materialize() if isinstance(v, LazyWeight) else v, value)


#: Tensor methods whose answer only the shape and dtype give (contiguous: whatever it becomes is made so when read).
_SHAPE_ONLY = frozenset({"size", "nelement", "element_size", "is_floating_point", "is_complex", "is_contiguous"})
#: torch functions a LazyWeight follows, and its method doing it.
_FOLLOWED = {f: name for name in ("narrow", "chunk", "split", "unbind", "select", "squeeze", "unsqueeze",
                                  "transpose", "permute", "t", "reshape", "detach", "contiguous", "clone")
             for f in (getattr(torch, name, None), getattr(torch.Tensor, name)) if f is not None}


def _operator(name: str):
    def op(self, *args):
        return getattr(self.materialize(), name)(*_materialized(args))

    op.__name__ = name
    return op


for _name, _to in (("float", torch.float32), ("half", torch.float16), ("bfloat16", torch.bfloat16),
                  ("double", torch.float64), ("cpu", "cpu")):
    setattr(LazyWeight, _name, functools.partialmethod(LazyWeight.to, _to))
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__neg__",
              "__float__", "__int__", "__array__"):
    setattr(LazyWeight, _name, _operator(_name))
