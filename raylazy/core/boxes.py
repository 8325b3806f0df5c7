"""Which byte ranges of a checkpoint tensor hold a box of it: the one geometry of reads, for the planner's shards
(a slicing's pieces, `raylazy.core.planner`) and lazy weights' regions (`Region`, `raylazy.integrations.lazy`),
and the one rule of whether strided rows are read as one range with their gaps (`gathering`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import product
from math import prod

from ..errors import PartialByteSliceError
from .costs import CostModel
from .dtypes import DTYPE_BITS
from .header import TensorInfo
from .plans import Read, TensorShard, read_of

#: Whether `count` rows of `length` bytes, `stride` bytes apart, are read as one range with their gaps:
#: `gather(length, stride, count)`.
Gather = Callable[[int, int, int], bool]


@dataclass(frozen=True)
class Region:
    """The box `starts` .. `starts + sizes` of tensor `tensor` (in checkpoint file `file`): what a lazy weight reads."""

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
    def order(self) -> tuple:
        """Where the region lies in the checkpoint: regions sort in file and byte order."""
        return self.file, self.tensor.start, self.starts, self.sizes

    @property
    def span(self) -> tuple[int, int]:
        """(first byte, end byte) in its file of the bytes between the box's first element and its last (the box
        and, where it is strided, the gaps between its rows); whole bytes around sub-byte elements."""
        t, bits = self.tensor, DTYPE_BITS[self.tensor.dtype]
        if 0 in self.sizes:
            return t.start, t.start
        strides = [prod(t.shape[d + 1 :]) for d in range(len(t.shape))]
        first = sum(a * s for a, s in zip(self.starts, strides))
        last = sum((a + n - 1) * s for a, n, s in zip(self.starts, self.sizes, strides))
        return t.start + first * bits // 8, t.start + -(-(last + 1) * bits // 8)

    def narrow(self, dim: int, start: int, length: int) -> Region:
        """The region narrowed along box dim `dim` (already non-negative) to [start, start + length)."""
        size = self.sizes[dim]
        start = start + size if start < 0 else start
        if start < 0 or length < 0 or start + length > size:
            raise RuntimeError(f"{self.tensor.name}: narrow(dim={dim}, start={start}, length={length}) is out of "
                               f"range for size {size}")
        return Region(self.file, self.tensor, _put(self.starts, dim, self.starts[dim] + start),
                      _put(self.sizes, dim, length))

    def shard(self, name: str, gather: Gather, path: str) -> TensorShard:
        """The region as one shard of a rank plan, named `name` (placement "lazy": no rule chose it): its box's
        reads (`box_reads`), strided rows as one range where `gather` says (`path` names the file in errors)."""
        t = self.tensor
        cut = [d for d, (n, full) in enumerate(zip(self.sizes, t.shape)) if n != full]
        try:
            reads = box_reads(self.file, t, self.starts, self.sizes, gather)
        except PartialByteSliceError as e:
            raise PartialByteSliceError(f"{path}: tensor {t.name!r}: {e}") from None
        return TensorShard(name=name, file=self.file, offset=t.start, dtype=t.dtype, full_shape=t.shape,
                           shape=self.sizes, placement="lazy", dim=cut[0] if cut else None,
                           pieces=((self.starts[cut[0]], 0, self.sizes[cut[0]]),) if cut else (), reads=reads)


def batch_cuts(wants: list[dict[Region, int]], budget: float) -> list[list[list[Region]]]:
    """The regions the processes of a node want (process -> region -> the bytes it holds of it: 0 for one read
    straight into its destination), in checkpoint order, cut into batches (batch -> process -> its regions) so
    that no process holds more than `budget` bytes in one batch."""
    regions = sorted({r for w in wants for r in w}, key=lambda r: r.order)
    batches: list[list[list[Region]]] = []
    held = [0] * len(wants)
    for r in regions:
        add = [w.get(r) for w in wants]
        if not batches or any(h + (a or 0) > budget and h for h, a in zip(held, add)):
            batches.append([[] for _ in wants])
            held = [0] * len(wants)
        for i, a in enumerate(add):
            if a is not None:
                batches[-1][i].append(r)
                held[i] += a
    return batches


def gathering(max_gap: int | None, cost: CostModel | None) -> Gather:
    """Strided rows read as one range where the gaps between them are at most `max_gap` bytes; with `max_gap`
    None, where the storage's `cost` model estimates that sooner (object storage), else never (local files, where
    a request costs little)."""
    if max_gap is None and cost is not None:
        return cost.gather
    gap = max_gap or 0
    return lambda length, stride, count: stride - length <= gap


def box_reads(file: int, t: TensorInfo, starts: tuple[int, ...], sizes: tuple[int, ...], gather: Gather,
              into: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> tuple[Read, ...]:
    """The reads of the box `starts` .. `starts + sizes` of tensor `t` (in file `file`) into a row-major
    destination: the box itself, or with `into` = (shape, starts) the box at `starts` of a destination of
    `shape` (a shard that several pieces fill; dims the box does not cut have the tensor's size there).

    After the last dim the box does not take whole (d), every run of the box is contiguous in the file and in
    the destination; the runs over the whole dims between the last such dim before d (j) and d lie one stride
    apart, so each index of the dims before j is one Read of `count` rows, `gather` saying whether they come as
    one range. A PartialByteSliceError where a sub-byte tensor's run does not start and end on whole bytes."""
    shape = t.shape
    out, at = into if into else (sizes, None)
    if sizes == shape == out:  # the whole tensor, into all of the destination
        return whole_reads(file, t)
    d, step = len(shape) - 1, DTYPE_BITS[t.dtype]
    while sizes[d] == shape[d] == out[d]:
        step *= shape[d]
        d -= 1
    if 0 in sizes:
        return ()
    # one index of dim d is `step` bits in the tensor and in the destination (the dims after d are whole in both);
    # walking back over the whole dims before d, the rows of a Read are `stride` (`dst_stride`) bits apart
    run, src, dst = sizes[d] * step, starts[d] * step, at[d] * step if at else 0
    stride, dst_stride, j, count = shape[d] * step, out[d] * step, d - 1, 1
    src_step, dst_step = stride, dst_stride  # bits between indices of dim j
    while j > 0 and sizes[j] == shape[j] == out[j]:
        count, src_step, dst_step, j = count * sizes[j], src_step * shape[j], dst_step * out[j], j - 1
    if d:  # dim j's own indices are rows too; its start moves the first
        count, src, dst = count * sizes[j], src + starts[j] * src_step, dst + (at[j] * dst_step if at else 0)
    if j <= 0:  # one Read
        return (_read(file, t, starts, sizes, src, dst, run, count, stride, dst_stride, gather),)
    src_steps, dst_steps = [src_step * shape[j]], [dst_step * out[j]]  # of dims j - 1, ..., 0
    for k in range(j - 1, 0, -1):
        src_steps.append(src_steps[-1] * shape[k])
        dst_steps.append(dst_steps[-1] * out[k])
    src_steps.reverse()
    dst_steps.reverse()
    return tuple(_read(file, t, starts, sizes, src + sum((a + i) * n for a, i, n in zip(starts, outer, src_steps)),
                       dst + sum(((at[k] if at else 0) + i) * n for k, (i, n) in enumerate(zip(outer, dst_steps))),
                       run, count, stride, dst_stride, gather)
                 for outer in _indices(sizes[:j]))


def whole_reads(file: int, t: TensorInfo) -> tuple[Read, ...]:
    """The reads of all of tensor `t` (in file `file`): one range, none for an empty tensor (`box_reads` of its
    whole box, without looking at its dims: the planner asks this once per tensor every rank holds whole)."""
    return (read_of((file, t.start, t.end - t.start, 0, 1, 0, 0, False)),) if t.end > t.start else ()


def _read(file: int, t: TensorInfo, starts, sizes, src: int, dst: int, run: int, count: int, stride: int,
          dst_stride: int, gather: Gather) -> Read:
    """One Read of `count` runs of `run` bits at tensor bit `src` (`stride` apart) -> destination bit `dst`."""
    if (src | run | dst | ((stride | dst_stride) if count > 1 else 0)) % 8:
        raise PartialByteSliceError(f"{_describe(starts, sizes, t.shape)} of {t.dtype} {list(t.shape)} does not "
                                    "start and end on whole bytes")
    if count == 1:
        return Read(file, t.start + src // 8, run // 8, dst // 8)
    return Read(file, t.start + src // 8, run // 8, dst // 8, count, stride // 8, dst_stride // 8,
                gather(run // 8, stride // 8, count))


def _indices(sizes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every index of a box of `sizes`, in row-major order (one empty index for no dims)."""
    return product(*map(range, sizes))


def _describe(starts: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """`the slice [a:b] along dim d` (one dim cut), else `the box [a:b, :, ...]`."""
    cut = [k for k, (n, full) in enumerate(zip(sizes, shape)) if n != full]
    if len(cut) == 1:
        return f"the slice [{starts[cut[0]]}:{starts[cut[0]] + sizes[cut[0]]}] along dim {cut[0]}"
    return "the box [" + ", ".join(f"{a}:{a + n}" if k in cut else ":" for k, (a, n) in
                                   enumerate(zip(starts, sizes))) + "]"


def _put(values: tuple, i: int, v) -> tuple:
    return values[:i] + (v,) + values[i + 1 :]
