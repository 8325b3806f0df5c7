"""The recording of a consumer's first run over lazy weights (`raylazy.integrations.lazy`): the copies it deferred,
the regions ops it cannot follow read at once, and whether replaying the deferred copies (in any order that keeps
overlapping destinations in turn) leaves the consumer's tensors as the run would have: no tensor a deferred copy
writes was used by another op afterwards (a `TorchFunctionMode` watches the run), and every destination is one of
the model's own tensors. Otherwise the consumer runs again. `Served` is a run over a serving of the regions
(`raylazy.io.serving`); `replay` makes the recorded copies out of one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import torch
from torch.overrides import TorchFunctionMode

from ..core.boxes import Region
from ..core.dtypes import itemsize, torch_dtype
from .lazy import LazyWeight, Lens, deferred


@dataclass(frozen=True)
class Copy:
    """A copy a run deferred: `dst.copy_(weight)` (the weight's region seen through its lens)."""

    dst: torch.Tensor
    region: Region
    lens: Lens

    def do(self, box: torch.Tensor) -> torch.Tensor:
        """The copy, from the region's `box` as read, through the weight's conversions, the last made as it is
        copied (one pass) where the copy reads the bytes in the destination's own order; none where the box was
        read into `dst` itself. Elsewhere each conversion is a `to()` first, as eager torch's: its `to()` keeps its
        input's layout, and torch's kernels keep a NaN's payload converting in order but not converting across
        a transposition."""
        shown = self.lens.shown(box, self.region.sizes)
        src = self.lens.converted(shown, self.dst.dtype if shown.is_contiguous() and self.dst.is_contiguous() else None)
        if not _same_memory(src, self.dst):
            self.dst.copy_(src)
        return self.dst


class Served:
    """Lazy weights' run over a serving of their regions (`raylazy.io.serving`): a take is the serving's, a copy
    is made out of the region's box."""

    def __init__(self, serving):
        self.serving = serving

    def take(self, region: Region) -> torch.Tensor:
        return self.serving.take(region)

    def copy_into(self, dst: torch.Tensor, weight: LazyWeight) -> torch.Tensor:
        return Copy(dst, weight.region, weight.lens).do(self.serving.box(weight.region))


def replay(serving, copies: list[Copy]) -> None:
    """Make the recorded copies out of `serving`: in its order where it reads in that order (`Serving.ordered`: no
    two destinations overlap), else in the order recorded."""
    if serving.ordered:
        copies = sorted(copies, key=lambda c: serving.order(c.region))
    for c in copies:
        c.do(serving.box(c.region))
        serving.copied_from(c.region)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same elements of the same memory in the same order (whatever dims of size 1
    they add or drop): a copy of one into the other would change nothing."""
    return a.dtype == b.dtype and a.numel() == b.numel() and a.data_ptr() == b.data_ptr() and \
        a.is_contiguous() and b.is_contiguous()


class Recording:
    """The first run: copies deferred (`copies`, in order), regions used by ops that cannot be followed read at
    once by `read_now(region)` (`opaque`, with their takes), and whether the deferred copies can be replayed."""

    def __init__(self, read_now: Callable[[Region], torch.Tensor]):
        self.read_now = read_now
        self.copies: list[Copy] = []
        self.opaque: dict[Region, int] = {}
        self.why_not_replayable = ""  # the first reason, if any
        self._written: dict[int, list[tuple[int, int]]] = {}  # storage -> byte extents deferred copies write

    @property
    def replayable(self) -> bool:
        return not self.why_not_replayable

    def take(self, region: Region) -> torch.Tensor:
        self.opaque[region] = self.opaque.get(region, 0) + 1
        return self.read_now(region)

    def copy_into(self, dst: torch.Tensor, weight: LazyWeight) -> torch.Tensor:
        if not broadcasts_to(tuple(weight.shape), tuple(dst.shape)):
            raise RuntimeError(f"{weight.region.tensor.name}: cannot copy a tensor of shape {list(weight.shape)} "
                               f"into one of shape {list(dst.shape)}")
        self.copies.append(Copy(dst, weight.region, weight.lens))
        key, lo, hi = extent(dst)
        if hi > lo:
            self._written.setdefault(key, []).append((lo, hi))
        return dst

    def not_replayable(self, why: str) -> None:
        self.why_not_replayable = self.why_not_replayable or why

    def watching(self) -> _Watch:
        """A context in which every torch op is watched for use of what a deferred copy wrote (see `_Watch`)."""
        return _Watch(self)

    def overlaps(self, t: torch.Tensor) -> bool:
        key, lo, hi = extent(t)
        return any(a < hi and lo < b for a, b in self._written.get(key, ()))

    def check_targets(self, tensors) -> None:
        """Not replayable unless every copy's destination lies in one of `tensors` (the model's parameters and
        buffers, as the run left them)."""
        storages = {t.untyped_storage().data_ptr() for t in tensors}
        stray = next((c for c in self.copies if c.dst.untyped_storage().data_ptr() not in storages), None)
        if stray is not None:
            self.not_replayable(f"{stray.region.tensor.name!r} was copied into a tensor that is not one of the "
                                "model's parameters or buffers")


def broadcasts_to(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """Whether `dst.copy_(src)` takes a source of shape `src` into `dst` (torch expands it: no more dims, each 1 or
    equal, aligned from the last). Asked for every deferred copy: `torch.broadcast_shapes` takes ~10 us a call."""
    return len(src) <= len(dst) and all(s in (1, d) for s, d in zip(reversed(src), reversed(dst)))


def extent(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of the memory a tensor spans (end = first for an empty one)."""
    if not t.numel():
        return 0, 0, 0
    size = t.element_size()
    lo = t.storage_offset() * size
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().data_ptr(), lo, lo + span * size


#: Tensor attributes and methods that neither read nor write the data.
_METADATA = frozenset({
    "shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device", "stride", "storage_offset",
    "is_contiguous", "element_size", "layout", "requires_grad", "requires_grad_", "is_cuda", "is_cpu", "is_meta",
    "data_ptr", "untyped_storage", "nbytes", "itemsize", "__len__", "is_floating_point", "is_complex", "is_sparse",
    "is_quantized", "names", "grad", "_version", "__hash__", "is_leaf", "output_nr", "_base", "is_inference"})
#: Tensor methods whose result may be a view of their input (then nothing was read).
_VIEWS = frozenset({
    "narrow", "select", "__getitem__", "view", "view_as", "reshape", "reshape_as", "transpose", "t", "T", "mT",
    "permute", "unsqueeze", "squeeze", "expand", "expand_as", "chunk", "split", "unbind", "as_strided", "detach",
    "flatten", "unflatten", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "contiguous", "data",
    "tensor_split", "split_with_sizes", "unfold", "__torch_function__", "_make_subclass", "__new__", "to"})


def _op_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: Tensor.data.__get__ is "data", its setter "data="
        return getattr(getattr(func, "__self__", None), "__name__", name) + ("=" if name == "__set__" else "")
    return name


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in `value` (in lists, tuples and dicts too). Plain recursion, not torch's pytree: the watch asks
    it of every op a consumer's run makes, and this is 2-3 x quicker on an op's few arguments."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return []
    return [t for v in value for t in _tensors(v)]


class _Watch(TorchFunctionMode):
    """Marks a recording not replayable at the first op that reads or writes bytes a deferred copy writes (which
    the run has not written yet), lazy weights among its arguments or not: a view of them, or their shape, is no
    use of their bytes, and a copy the run defers is none either (it writes them in turn)."""

    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copy = deferred(func, args)
        out = func(*args, **kwargs)
        rec = self.recording
        if rec._written and rec.replayable and not copy:
            name = _op_name(func)
            if name not in _METADATA:
                hit = [t for t in _tensors((args, kwargs)) if rec.overlaps(t)]
                if hit and not (name in _VIEWS and _views_of(out, hit[0])):
                    rec.not_replayable(f"{name} used a tensor that a deferred copy writes, after that copy")
        return out


def _views_of(out, t: torch.Tensor) -> bool:
    """Whether every tensor in `out` shares `t`'s storage (a view: nothing read)."""
    key = t.untyped_storage().data_ptr()
    return all(o.untyped_storage().data_ptr() == key for o in _tensors(out))


def overlapping(tensors: list[torch.Tensor]) -> set[int]:
    """Indices of the tensors whose memory overlaps another's: in order of where they start, one overlaps an
    earlier one where it starts before the furthest end of those, and a later one where the next starts before
    its own end."""
    spans = sorted((extent(t), i) for i, t in enumerate(tensors) if t.numel())
    hit: set[int] = set()
    reach = (None, 0)  # (storage, the furthest end so far in it)
    for n, ((key, start, end), i) in enumerate(spans):
        following = spans[n + 1][0] if n + 1 < len(spans) else (None, 0, 0)
        if reach[0] == key and start < reach[1] or following[0] == key and following[1] < end:
            hit.add(i)
        reach = (key, max(end, reach[1]) if reach[0] == key else end)
    return hit


def in_place(copies: list[Copy], device: torch.device, shared: set[int]) -> dict[Region, torch.Tensor]:
    """{region: its destination viewed with the box's sizes} for the regions a replay reads straight into one: the
    first copy of each whose destination holds the box's bytes in order (contiguous, its dtype, on `device`)
    and overlaps no other destination (`shared`: the copies whose do, `overlapping`)."""
    out: dict[Region, torch.Tensor] = {}
    for i, c in enumerate(copies):
        stored = torch_dtype(c.region.tensor.dtype)
        if c.region in out or i in shared or itemsize(c.region.tensor.dtype) is None or not c.lens.in_order:
            continue
        d = c.dst
        if not c.lens.dtypes and stored == d.dtype and c.lens.device in (None, d.device) and \
                d.device == device and d.is_contiguous() and d.numel() == prod(c.region.sizes):
            out[c.region] = d.view(c.region.sizes)
    return out


def wanted(copies: list[Copy], opaque: dict[Region, int] | None = None) -> dict[Region, int]:
    """Region -> takes, of a replay of `copies` (and of a second run that also takes `opaque` again)."""
    return dict(Counter(c.region for c in copies) + Counter(opaque or {}))
