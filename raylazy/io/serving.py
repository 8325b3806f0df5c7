"""Serving the regions a process's consumer takes (`raylazy.io.regions.RegionReader` reads them): `Serving`
reads them in batches on a background thread, in checkpoint order, so that no process holds more than
`batch_bytes` of regions beyond those read straight into their destination; where the takes come in batch order
(a replay), the regions of batch b are read into ring buffer b mod (batches_ahead + 1), reused from batch to batch
(fresh memory costs a page fault per page, about as much as the copy out of it). The processes loading the
checkpoint at once on one node (vLLM's workers: a `NodeGroup`) cut the node's regions into the same batches, each one
node read (`raylazy.io.nodes.node_reads`); a process alone on its node, or asked for `ranged` or `fastsafetensors`,
reads its own regions. Copying out of the files' mappings (the backend "cooperative", `raylazy.core.choices`),
nothing is read ahead: each region is a view of its file's mapping, and a copy out of it into its destination is
the only pass over its bytes, its page faults reading them once for the node (the page cache), as vLLM's own loader
copies out of its mapping; only regions a view cannot show (sub-byte dtypes) are read in batches. Where the
checkpoint is in the page cache already, nothing is recorded: `AtOnce` serves the consumer's one run, each region
as it is asked.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..core.boxes import Region, batch_cuts
from ..core.choices import NODE_BACKENDS
from ..core.dtypes import itemsize, torch_dtype
from ..core.plans import RankPlan
from ..core.schedule import NodeRead
from ..errors import LazyWeightError
from .collective import Exchange, close_rendezvous, collective_backend, serve_rendezvous
from .mapping import box_mappable, populating
from .nodes import NodeGroup, node_key, node_reads
from .regions import RegionReader


@dataclass
class _Peer:
    """What each process tells the others: its node, an exchange address and a load id (its node's first
    process's are used), and the regions it wants (checkpoint tensor index, starts, sizes, bytes held)."""

    node: str
    address: str
    load_id: str
    wants: list[tuple[int, tuple, tuple, int]]


@dataclass
class _Batch:
    regions: list[Region]  # this process's
    left: int  # regions of the batch not yet taken their last time
    plan: RankPlan | None = None  # this process's part of the batch's node read, if the node reads it
    node_read: NodeRead | None = None
    read: bool = False


class Serving:
    """Reads the regions this process wants (`takes`: region -> times taken; `out`: those read straight into a
    destination) onto `device` in batches on a background thread, at most `batches_ahead` beyond the ones not yet
    fully taken unless a take waits for a later one, and hands them out (`take`; `box` to copy out of, then
    `copied_from`). `group`: the processes loading the checkpoint at once (making a Serving is then a collective).
    `ordered`: the takes come in batch order (`order`: a replay of copies no two of whose destinations overlap),
    so a batch's regions may be read into a reused buffer once every copy out of the batch `batches_ahead + 1`
    before it is done. Use as a context manager: leaving it stops the reader."""

    def __init__(self, reads: RegionReader, takes: dict[Region, int], out: dict[Region, torch.Tensor] | None = None,
                 group: NodeGroup | None = None, device: str | torch.device = "cpu", ordered: bool = False):
        self.reads, self.options, self.stats, self.device = reads, reads.options, reads.stats, str(device)
        self._left, self._out = dict(takes), dict(out or {})
        self._ring: list[torch.Tensor] | None = [] if ordered else None  # the reused buffers, in ordered takes
        self._copying = False  # whether regions are copied out of their files' mappings
        self._reads_in_place = False  # whether, then, the regions read straight into their destination still are
        self.stats.regions, self.stats.bytes_needed = len(takes), sum(r.nbytes for r in takes)
        self.backend, self._batches, self._session = self._plan(group)
        # in place: read straight into their destination, or copied straight out of the mapping (planned: its pages)
        copied = sum(r.nbytes for r in takes if self._copied(r))
        self.stats.in_place_bytes = copied + sum(r.nbytes for r in self._out if not self._copied(r))
        self.stats.planned_bytes_read += copied
        self.stats.backend, self.stats.batches = self.backend, len(self._batches)
        self._batch_of = {r: b for b, batch in enumerate(self._batches) for r in batch.regions}
        self._ready: dict[Region, torch.Tensor] = {}
        self._wanted = -1  # the latest batch a take waits for
        self._taken = 0  # batches fully taken
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="raylazy-lazy-reader", daemon=True)
        self._populating = ExitStack()
        self._reached: Callable[[int], None] = lambda address: None  # tells the populating threads a copy's place

    def _held(self) -> dict[Region, int]:
        return {r: 0 if r in self._out else r.nbytes for r in self._left if not self._copied(r)}

    def _plan(self, group: NodeGroup | None) -> tuple[str, list[_Batch], object]:
        """(backend, batches, the context the reader thread reads in): alone, or with the node's processes."""
        requested = self.options.reader.backend
        budget = self.options.batch_bytes if requested != "fastsafetensors" else float("inf")
        together = group is not None and group.size > 1 and requested in ("auto", *NODE_BACKENDS)
        peers, here, local = self._peers(group) if together else ([], [0], 0)
        choice = self.reads.choice(len(here), self.device)
        if together and (choice.backend != "exchange" or local):  # the node meets at its first process's, if at all
            close_rendezvous(peers[group.rank].address)
        self.stats.node_processes = len(here)
        if choice.backend == "cooperative":  # copied out of the files' mappings; the rest read alone, in batches
            self._copying, self._reads_in_place = True, choice.reads_in_place
            return "cooperative", self._alone("ranged", budget)[1], nullcontext()
        if not choice.with_node:
            return self._alone(choice.backend, budget)
        tensors = list(self.reads.ckpt.tensors())
        wants = [{Region(*tensors[i], starts, sizes): held for i, starts, sizes, held in peers[p].wants} for p in here]
        first = peers[here[0]]
        batches = [self._node_batch(cut, local, f"{first.load_id}-{b}", first.address)
                   for b, cut in enumerate(batch_cuts(wants, budget))]
        if not batches and not local:
            close_rendezvous(first.address)
        session = _exchange(local, len(here), first.address, self.device, self.options.reader.stripe_timeout_s) \
            if batches else nullcontext()
        return "exchange", batches, session

    def _peers(self, group: NodeGroup) -> tuple[list[_Peer | None], list[int], int]:
        """Every process's `_Peer` (None from one copying at once: `AtOnce`), those on this node, and this one's place
        among them (the gathering is a collective: every process of the group makes it)."""
        index = {t.name: i for i, (_, t) in enumerate(self.reads.ckpt.tensors())}
        me = _Peer(node_key(), serve_rendezvous("127.0.0.1"), uuid.uuid4().hex,
                   [(index[r.tensor.name], r.starts, r.sizes, held) for r, held in self._held().items()])
        peers = group.gather(me)()
        here = [i for i, p in enumerate(peers) if p is not None and p.node == me.node]
        return peers, here, here.index(group.rank)

    def _alone(self, backend: str, budget: float) -> tuple[str, list[_Batch], object]:
        """This process reading its own regions with `backend`, in batches of `budget` held bytes."""
        return backend, [_Batch(b[0], len(b[0])) for b in batch_cuts([self._held()], budget)], nullcontext()

    def _node_batch(self, cut: list[list[Region]], local: int, load_id: str, address: str) -> _Batch:
        """A batch as local process `local` reads it with the node: its plan and the node's read
        (`raylazy.io.nodes.node_reads`, the node meeting at `address`)."""
        exchange = self.options.reader.model_copy(update={"backend": "exchange"})  # chosen once, in `_plan`
        plan, reads = node_reads(self.reads.plan(cut), ["node"] * len(cut), [self.device] * len(cut), exchange,
                                 load_id, lambda ranks: [address])
        self.stats.node_bytes += plan.nodes[0].nbytes
        return _Batch(cut[local], len(cut[local]), plan.ranks[local], reads[local].node_read)

    def __enter__(self) -> Serving:
        if self._copying:  # the regions copied out of the mappings brought in ahead, in checkpoint order
            spans = _merged(sorted((r.file, *r.span) for r in self._left if self._copied(r)))
            reader = self.options.reader
            self._reached = self._populating.enter_context(populating(
                [(self.reads.mapping(f), a, b) for f, a, b in spans], reader.threads, reader.chunk_bytes))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self._populating.close()

    def drain(self) -> None:
        """Read every batch left and stop the reader (takes may then come after the serving is left)."""
        with self._cond:
            self._wanted = len(self._batches)
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            with self._session as exchange:
                for b, batch in enumerate(self._batches):
                    with self._cond:
                        while not self._stop and (b > self._wanted and b - self._taken > self.options.batches_ahead
                                                   or not self._slot_free(b)):
                            self._cond.wait()
                        if self._stop:
                            raise _Stopped
                    out = {r: self._out[r] for r in batch.regions if r in self._out}
                    if self._ring is not None:
                        out.update(self._staging(b))
                    got = self.reads.read(batch.regions, backend=self.backend, device=self.device, out=out,
                                          plan=batch.plan, node_read=batch.node_read, exchange=exchange)
                    with self._cond:
                        self._ready.update(got)
                        batch.read = True
                        self._taken += not batch.left
                        self._cond.notify_all()
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001  (handed to the take that waits: the load fails there, with it)
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _slot_free(self, b: int) -> bool:
        """Whether batch b's ring buffer holds no region still to be taken (always, without a ring)."""
        k = self.options.batches_ahead + 1
        return self._ring is None or b < k or not self._batches[b - k].left

    def _staged(self, batch: _Batch) -> tuple[list[Region], list[int]]:
        """A batch's regions read into memory of their own (sub-byte dtypes aside: they get memory of their own),
        and where each starts in its ring buffer (on a 64-byte boundary, as torch's own allocations do; last: the
        bytes they take)."""
        regions = [r for r in batch.regions if r not in self._out and itemsize(r.tensor.dtype)]
        at = [0]
        for r in regions:
            at.append(at[-1] + -(-r.nbytes // 64) * 64)
        return regions, at

    def _staging(self, b: int) -> dict[Region, torch.Tensor]:
        """Batch b's staged regions as views of its ring buffer (each made once, as large as the largest of its
        batches: one large batch makes one large buffer)."""
        if not self._ring:
            k = min(len(self._batches), self.options.batches_ahead + 1)
            sizes = [max(self._staged(batch)[1][-1] for batch in self._batches[i::k]) for i in range(k)]
            self._ring = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        buf = self._ring[b % len(self._ring)]
        regions, at = self._staged(self._batches[b])
        return {r: buf[a : a + r.nbytes].view(torch_dtype(r.tensor.dtype)).view(r.sizes) for r, a in zip(regions, at)}

    def _copied(self, region: Region) -> bool:
        """Whether the region is copied out of its file's mapping."""
        return self._copying and box_mappable(region) and not (self._reads_in_place and region in self._out)

    def _mapped_box(self, region: Region) -> torch.Tensor:
        """The region's box in its file's mapping; the threads populating it ahead are told the copies got there."""
        self._reached(self.reads.mapping(region.file).data_ptr() + region.span[0])
        return self.reads.mapped_box(region)

    def box(self, region: Region) -> torch.Tensor:
        """The region's box to copy out of, not to keep: a view of the file's mapping, else as read (`take`)."""
        return self._mapped_box(region) if self._copied(region) else self.take(region, keep=False)

    def take(self, region: Region, keep: bool = True) -> torch.Tensor:
        """The region's box (waits for its batch; out of the file's mapping, into memory of its own, where regions
        are copied out of it); a region not wanted is read on its own, at once, and counted. `keep`: the taker may
        write into it, so it is memory of its own (a copy of the box, but on its last take)."""
        if self._copied(region):  # its takes left never change: no batch holds it
            if not self._left.get(region):
                self.stats.unplanned_regions += 1
                self.stats.unplanned_bytes += region.nbytes
            # a consumer may write into what it takes: not into the mapping others copy from
            return self._mapped_box(region).clone()
        with self._cond:
            if self._left.get(region):
                return self._take_wanted(region, keep)
        self.stats.unplanned_regions += 1
        self.stats.unplanned_bytes += region.nbytes
        return self.reads.read_alone(region)

    def _take_wanted(self, region: Region, keep: bool) -> torch.Tensor:
        """A wanted region with takes left (called holding the lock): waits for its batch, frees it on its last take
        (a copy of it for a take kept before that)."""
        b = self._batch_of[region]
        self._wanted = max(self._wanted, b)
        self._cond.notify_all()
        while not self._batches[b].read and self._error is None and not self._stop:
            self._cond.wait()
        if self._error is not None:
            raise self._error
        if not self._batches[b].read:
            raise LazyWeightError(f"{region.tensor.name}: a lazy weight was used after the load that serves it "
                                  "ended (a weight loader kept a checkpoint weight past load_weights)")
        self._left[region] -= 1
        if self._left[region]:
            return self._ready[region].clone() if keep else self._ready[region]
        if self._ring is None:  # its memory is the taker's: nothing else is read into it
            self._taken_all(b)
        return self._ready.pop(region)

    def _taken_all(self, b: int) -> None:
        """One more of batch b's regions was taken for the last time (called holding the lock)."""
        self._batches[b].left -= 1
        if not self._batches[b].left:
            self._taken += 1
            self._cond.notify_all()

    def copied_from(self, region: Region) -> None:
        """A copy out of `region` is done: in ordered takes, once its last take's copy is, its ring buffer may be
        read into again (not before: the copy reads it). On a GPU the copies are only queued on this thread's
        stream, and the reader writes on a stream of its own: the batch's last one waits for them."""
        b = self._batch_of.get(region)
        if self._ring is not None and b is not None and not self._left[region]:
            if self._batches[b].left == 1 and torch.device(self.device).type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            with self._cond:
                self._taken_all(b)

    @property
    def ordered(self) -> bool:
        """Whether the takes come in batch order (a ring of buffers is reused)."""
        return self._ring is not None

    def order(self, region: Region) -> tuple:
        """Where a copy out of `region` comes in batch order (checkpoint order out of the files' mappings)."""
        return self._batch_of.get(region, -1), region.order


class AtOnce:
    """Regions served as the consumer asks, in its one run: a copy goes out of the region's file mapping
    straight into its destination (`box`), an op raylazy cannot follow gets a copy of the region (`take`,
    read alone where a view cannot show it: sub-byte dtypes). For a checkpoint in the page cache
    (`RegionReader.copies_at_once`), where nothing is left to read ahead or to share with the node: one pass over
    the bytes, as vLLM's own loader makes over its mapping, and no recording to replay. Counts the takes of each
    region (`taken`) and of those ops (`opaque`), and the bytes copied straight out of a mapping (`in_place`).

    A context manager. This process's part in its load's one gathering (`group`'s) is None: it reads nothing with
    the others, and those that record plan their node's read without it. Entering starts that part, leaving waits
    for it, once every copy is made (and puts the counts in the reader's stats): each process of a load gathers
    once, whichever way it loads, so none has to wait for the others before it starts, and one copying at once
    waits at the end only for those that record."""

    def __init__(self, reads: RegionReader, group: NodeGroup | None = None):
        self.reads, self.group, self.taken, self.opaque, self.in_place = reads, group, Counter(), Counter(), 0
        self._gathered: Callable[[], list] = list

    def __enter__(self) -> AtOnce:
        if self.group is not None and self.group.size > 1:
            self._gathered = self.group.gather(None)
        return self

    def __exit__(self, *exc) -> None:
        s = self.reads.stats
        s.backend, s.regions, s.bytes_needed, s.in_place_bytes = ("cooperative", len(self.taken),
                                                                  sum(r.nbytes for r in self.taken), self.in_place)
        s.count_opaque(self.opaque)
        self._gathered()

    def _box(self, region: Region) -> torch.Tensor:
        return self.reads.mapped_box(region) if box_mappable(region) else self.reads.read_alone(region)

    def take(self, region: Region) -> torch.Tensor:
        """The region as memory of its own (for an op raylazy cannot follow)."""
        self.taken[region] += 1
        self.opaque[region] += 1
        box = self._box(region)  # a consumer may write into what it takes: not into the mapping
        return box.clone() if box_mappable(region) else box

    def box(self, region: Region) -> torch.Tensor:
        """The region's box to copy out of, not to keep: a view of its file's mapping where one shows it."""
        self.taken[region] += 1
        self.in_place += region.nbytes if box_mappable(region) else 0
        return self._box(region)

    def copied_from(self, region: Region) -> None:
        """Nothing to free: nothing is read ahead."""

    def drain(self) -> None:
        """Nothing is read ahead: every region was copied as it was asked."""


def _merged(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Sorted (file, first byte, end byte) spans, those that touch or overlap merged."""
    out: list[tuple[int, int, int]] = []
    for f, a, b in spans:
        if out and out[-1][0] == f and a <= out[-1][2]:
            out[-1] = (f, out[-1][1], max(b, out[-1][2]))
        else:
            out.append((f, a, b))
    return out


class _Stopped(Exception):
    """The serving was left before the reader finished."""


@contextmanager
def _exchange(local: int, size: int, address: str, device: str, timeout_s: float) -> Iterator[Exchange]:
    """One Exchange of the node's processes for all the batches (its rendezvous at the node's first process)."""
    with Exchange(collective_backend(device), local, size, address, timeout_s, device) as ex:
        yield ex
