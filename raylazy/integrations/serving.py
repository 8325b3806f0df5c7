"""Reading the regions a run of lazy weights took (`raylazy.integrations.lazy`) with raylazy's readers, in batches
on a background thread, and handing them out: to a replay of the run's deferred copies, or to a second run.

`RegionReader` reads regions of one checkpoint, each one shard of a rank plan (its box, read exactly; whole
tensors for fastsafetensors, the regions cut from them), its files checked once and kept open for the load.
`Serving` reads the regions a process wants in batches, in checkpoint order, so that no process holds more than
`batch_bytes` of regions beyond those read straight into their destination; where the takes come in batch order
(a replay), the regions of batch b are read into ring buffer b mod (batches_ahead + 1), reused from batch to batch
(fresh memory costs a page fault per page, about as much as the copy out of it). The processes loading the checkpoint
at once on one node (vLLM's workers: a `NodeGroup`) cut the node's regions into the same batches, each one node
read (`raylazy.core.schedule.node_schedule`) with the backend `raylazy.io.backends.backend_for` picks; a process
alone on its node, or asked for `ranged` or `fastsafetensors`, reads its own regions. Cooperatively (the node's
processes on one local file system, on the CPU) nothing is read ahead: each region is a view of its file's mapping
(`raylazy.io.cooperative.mapped_box`), and a copy out of it into its destination, converting as it copies, is the
only pass over its bytes, its page faults reading them once for the node (the page cache), as vLLM's own loader
copies out of its mapping; only regions a view cannot show (sub-byte dtypes) are read in batches. Where the
checkpoint is in the page cache already, nothing is recorded: `AtOnce` serves the consumer's one run (a load's
`load_weights`, a reload's weight loaders), each copy straight out of the mapping as it is asked.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..core.boxes import Region, batch_cuts, gathering
from ..core.checkpoint import Checkpoint
from ..core.dtypes import itemsize, torch_dtype
from ..core.mesh import Mesh
from ..core.plans import FileRef, Plan, RankPlan
from ..core.schedule import NodeRead, node_schedule
from ..errors import LazyWeightError
from ..io.backends import NODE_BACKENDS, backend_for, node_read, read_rank, shares_page_cache, solo_backend
from ..io.collective import Exchange, close_rendezvous, collective_backend, serve_rendezvous
from ..io.cooperative import box_mappable, cached_share, mapped, mapped_box, populating, unmap_later
from ..storage import open_planned_files, storage_for
from .lazy import LazyWeight
from .options import LazyOptions
from .recording import Copy, overlapping
from .report import LazyStats

#: The share of each file's pages in the page cache from which a checkpoint counts as there (`RegionReader.warm`):
#: the few pages a proactive reclaim took meanwhile (some virtual machines run one) the copies' faults read again.
WARM_SHARE = 0.9


class RegionReader:
    """Regions of one checkpoint read with raylazy's readers (a context manager: it holds the files open), every
    read counted in `stats`."""

    def __init__(self, ckpt: Checkpoint, options: LazyOptions):
        storage = storage_for(ckpt.root, options.reader.storage_options)
        self.storage = storage.kind(ckpt.root)
        costs = storage.cost_model(ckpt.root, self.storage)
        self.ckpt, self.options = ckpt, options.model_copy(update={"reader": options.reader.shaped(costs)})
        self.files = tuple(map(FileRef.of, ckpt.files))
        self.stats = LazyStats(storage=self.storage.name if self.storage else "")
        self._sources: dict[int, object] = {}
        self._maps: dict[int, torch.Tensor] = {}  # file -> its mapping (`mapping`)
        self._open = ExitStack()  # the files opened, closed on leaving
        self._lock = threading.Lock()
        self._none = RankPlan(rank=0, mesh=Mesh(), files=self.files, tensors=())
        self._gather = gathering(options.max_gap, costs)

    def __enter__(self) -> RegionReader:
        return self

    def __exit__(self, *exc) -> None:
        unmap_later(self._maps)  # the copies out of them are done: the load goes on while the kernel unmaps them
        self._open.close()
        self._sources.clear()

    def sources(self, files) -> dict[int, object]:
        """The files, opened and checked against the checkpoint's headers the first time one is asked for."""
        with self._lock:
            if new := [f for f in files if f not in self._sources]:
                self._sources.update(self._open.enter_context(open_planned_files(
                    self._none, new, self.options.reader.storage_options)))
            return {f: self._sources[f] for f in files}

    def mapping(self, file: int) -> torch.Tensor:
        """File `file` as a uint8 tensor over a mapping of it (`raylazy.io.cooperative.mapped`), made once."""
        m = self._maps.get(file)
        return m if m is not None else self._maps.setdefault(file, mapped(self.sources([file])[file]))

    def mapped_box(self, region: Region) -> torch.Tensor:
        """The region's box as a view of its file's mapping (only for a region `box_mappable` says a view shows)."""
        return mapped_box(self.mapping(region.file), region)

    def copies_at_once(self) -> bool:
        """Whether a load copies out of the page cache at once (`AtOnce`): where the options allow it (`warm_copies`,
        a backend that copies out of the files' mappings) and the checkpoint is in the page cache (`warm`)."""
        return self.options.warm_copies and self.options.reader.backend in ("auto", "cooperative") and self.warm()

    def warm(self) -> bool:
        """Whether the checkpoint is in the page cache: local files whose pages a mapping shares, each at least
        `WARM_SHARE` there (`raylazy.io.cooperative.cached_share`, a sample; the files are mapped to ask, and the
        first one short of it ends the asking)."""
        return shares_page_cache(self.files, self.storage) and all(
            cached_share(m.data_ptr(), m.numel()) >= WARM_SHARE for m in map(self.mapping, range(len(self.files))))

    def shard(self, region: Region, name: str):
        """The plan entry reading `region`."""
        return region.shard(name, self._gather, self.ckpt.files[region.file].path)

    def rank_plan(self, rank: int, regions: list[Region], mesh: Mesh = Mesh()) -> RankPlan:
        """Rank `rank`'s plan for `regions`: one shard each, named after its tensor and box."""
        return RankPlan(rank=rank, mesh=mesh, files=self.files, tensors=tuple(self.shard(r, _name(r)) for r in regions))

    def read(self, regions: list[Region], *, backend: str = "ranged", device: str = "cpu", out: dict | None = None,
             plan: RankPlan | None = None, node_read: NodeRead | None = None,
             exchange: Exchange | None = None) -> dict[Region, torch.Tensor]:
        """Each region's box as a tensor on `device`: read alone with `backend`, or as this process's part (`plan`)
        of a node read (`exchange`: the node's, open across batches)."""
        if backend == "fastsafetensors":
            return self._read_whole(regions, device)
        options = self.options.reader.model_copy(update={"backend": backend})
        plan = plan if plan is not None else self.rank_plan(0, regions)
        files = {r.file for t in plan.tensors for r in t.reads}
        if node_read is not None:  # and those of the stripes it reads for the node
            files |= {node_read.schedule.stripes[i].file for i in node_read.schedule.read_by(plan.rank)}
        got, stats = read_rank(plan, device, options=options, node_read=node_read, exchange=exchange,
                               out={_name(r): t for r, t in (out or {}).items()}, sources=self.sources(sorted(files)))
        with self._lock:
            self.stats.add_read(stats)
        return {r: got[_name(r)] for r in regions}

    def _read_whole(self, regions: list[Region], device: str) -> dict[Region, torch.Tensor]:
        """fastsafetensors: every tensor a region is in read whole, once; the regions cut from it, each in memory of
        its own where the tensor has several (a taker may write into what it takes)."""
        tensors = {r.tensor.name: Region.whole(r.file, r.tensor) for r in regions}
        shared = Counter(r.tensor.name for r in regions)
        plan = RankPlan(rank=0, mesh=Mesh(), files=self.files,
                        tensors=tuple(self.shard(w, name) for name, w in tensors.items()))
        got, stats = read_rank(plan, device, options=self.options.reader,
                               sources=self.sources(sorted({w.file for w in tensors.values()})))
        with self._lock:
            self.stats.add_read(stats)
        boxes = {r: got[r.tensor.name][tuple(slice(a, a + n) for a, n in zip(r.starts, r.sizes))] for r in regions}
        return {r: box.clone() if shared[r.tensor.name] > 1 else box for r, box in boxes.items()}

    def read_alone(self, region: Region) -> torch.Tensor:
        """One region read at once by this process alone, on the CPU (for an op raylazy cannot follow)."""
        return self.read([region], backend=solo_backend(self.options.reader.backend))[region]


def _name(region: Region) -> str:
    box = ",".join(f"{a}:{a + n}" for a, n in zip(region.starts, region.sizes))
    return f"{region.tensor.name}[{box}]"


class NodeGroup(Protocol):
    """The processes loading one checkpoint at once (vLLM's workers), this one being number `rank` of `size`."""

    rank: int
    size: int

    def gather(self, obj) -> Callable[[], list]:
        """Start this process's part in gathering every process's `obj` (a collective: all of them call it, in the
        same order); the call returned waits for the others and gives their objects, in rank order."""


class ProcessGroupNode:
    """The processes of a torch.distributed CPU (gloo) process group as a `NodeGroup` (vLLM's workers: its world's
    CPU group). A gathering is one all_gather, started without waiting, of a 256-byte slot per process: the size
    of its object pickled, then the pickle where it fits (a process copying at once sends None), and, only where
    one does not fit, a second all_gather of every pickle."""

    #: Pickled bytes a slot carries (the size before them: 8 bytes).
    INLINE = 248

    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self._group = rank, size, group

    def gather(self, obj) -> Callable[[], list]:
        data = pickle.dumps(obj)
        slot = _bytes(len(data).to_bytes(8, "little") + (data if len(data) <= self.INLINE else b""), 8 + self.INLINE)
        slots = [torch.empty_like(slot) for _ in range(self.size)]
        started = torch.distributed.all_gather(slots, slot, group=self._group, async_op=True)

        def wait() -> list:
            started.wait()
            sizes = [int.from_bytes(s[:8].numpy().tobytes(), "little") for s in slots]
            largest = max(sizes)
            if largest <= self.INLINE:
                return [pickle.loads(s[8 : 8 + n].numpy().tobytes()) for s, n in zip(slots, sizes)]
            whole = [torch.empty(largest, dtype=torch.uint8) for _ in range(self.size)]
            torch.distributed.all_gather(whole, _bytes(data, largest), group=self._group)
            return [pickle.loads(w[:n].numpy().tobytes()) for w, n in zip(whole, sizes)]

        return wait


def _bytes(data: bytes, n: int) -> torch.Tensor:
    """`data` at the start of a zeroed uint8 tensor of `n` bytes."""
    out = torch.zeros(n, dtype=torch.uint8)
    out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def node_key() -> str:
    """What identifies this machine (its page cache): the host name and the kernel's boot id."""
    boot = "/proc/sys/kernel/random/boot_id"
    return f"{socket.gethostname()}/{Path(boot).read_text().strip() if os.path.exists(boot) else ''}"


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
    fully taken unless a take waits for a later one, and hands them out (`take`, `copy_into`, `replay`). `group`:
    the processes loading the checkpoint at once (making a Serving is then a collective). `ordered`: the takes
    come in batch order (a `replay` of copies no two of whose destinations overlap), so a batch's regions may be
    read into a reused buffer once every copy out of the batch `batches_ahead + 1` before it is done. Use as a
    context manager: leaving it stops the reader."""

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
        if group is None or group.size < 2 or requested not in ("auto", *NODE_BACKENDS):
            # alone, "auto" copies out of the mappings too, but reads what a destination takes as it is with
            # ranged reads (many requests in flight, one pass), as "ranged" would (docs/vllm.md, "Backends")
            alone = backend_for("cooperative" if requested == "auto" else requested, 1, self.device, self.reads.files,
                                self.reads.storage)
            if alone != "cooperative":
                return self._alone(solo_backend(requested), budget)
            self._reads_in_place = requested == "auto"
            return self._copied_out(budget)
        tensors = list(self.reads.ckpt.tensors())
        index = {t.name: i for i, (_, t) in enumerate(tensors)}
        me = _Peer(node_key(), serve_rendezvous("127.0.0.1"), uuid.uuid4().hex,
                   [(index[r.tensor.name], r.starts, r.sizes, held) for r, held in self._held().items()])
        peers = group.gather(me)()  # None from a process copying at once (`AtOnce`): not reading with us
        here = [i for i, p in enumerate(peers) if p is not None and p.node == me.node]
        backend = backend_for(requested, len(here), self.device, self.reads.files, self.reads.storage)
        if backend != "exchange" or here[0] != group.rank:  # the node meets at its first process's server, if at all
            close_rendezvous(me.address)
        if backend not in NODE_BACKENDS:
            return self._alone(backend, budget)
        self.stats.node_processes = len(here)
        if backend == "cooperative":
            return self._copied_out(budget)
        wants = [{Region(*tensors[i], starts, sizes): held for i, starts, sizes, held in peers[p].wants} for p in here]
        first, local = peers[here[0]], here.index(group.rank)
        batches = [self._node_batch(cut, local, backend, f"{first.load_id}-{b}", first.address)
                   for b, cut in enumerate(batch_cuts(wants, budget))]
        if not batches:
            close_rendezvous(me.address)
        session = _exchange(local, len(here), first.address, self.device, self.options.reader.stripe_timeout_s) \
            if backend == "exchange" and batches else nullcontext()
        return backend, batches, session

    def _alone(self, backend: str, budget: float) -> tuple[str, list[_Batch], object]:
        """This process reading its own regions with `backend`, in batches of `budget` held bytes."""
        return backend, [_Batch(b[0], len(b[0])) for b in batch_cuts([self._held()], budget)], nullcontext()

    def _copied_out(self, budget: float) -> tuple[str, list[_Batch], object]:
        """Cooperative: the regions copied out of the files' mappings; the others (those no view shows, and those
        read in place where they still are) read alone with ranged reads, in batches."""
        self._copying = True
        return "cooperative", self._alone("ranged", budget)[1], nullcontext()

    def _node_batch(self, cut: list[list[Region]], local: int, backend: str, load_id: str, address: str) -> _Batch:
        """A batch as local process `local` reads it with the node (`backend`): its plan, the node's read."""
        mesh = Mesh(tp=len(cut))
        plans = tuple(self.reads.rank_plan(i, regions, mesh) for i, regions in enumerate(cut))
        plan = Plan(root=self.reads.ckpt.root, model_type=self.reads.ckpt.config.model_type, mesh=mesh,
                    max_gap=self.options.max_gap, uneven="error", checkpoint_bytes=self.reads.ckpt.nbytes,
                    files=self.reads.files, skipped=(), ranks=plans)
        sched = node_schedule(plan, range(len(cut)), stripe_bytes=self.options.reader.stripe_bytes)
        self.stats.node_bytes += sched.nbytes
        return _Batch(cut[local], len(cut[local]), plans[local], node_read(backend, plan, sched, load_id, address))

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

    def _copied_from(self, region: Region) -> None:
        """A copy out of `region` is done: in ordered takes, once its last take's copy is, its ring buffer may be
        read into again (not before: the copy reads it). On a GPU the copies are only queued on this thread's
        stream, and the reader writes on a stream of its own: the batch's last one waits for them."""
        b = self._batch_of.get(region)
        if self._ring is not None and b is not None and not self._left[region]:
            if self._batches[b].left == 1 and torch.device(self.device).type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            with self._cond:
                self._taken_all(b)

    def copy_into(self, dst: torch.Tensor, weight: LazyWeight) -> torch.Tensor:
        return Copy(dst, weight.region, weight.lens).do(self.box(weight.region))

    def replay(self, copies: list[Copy]) -> None:
        """Do the recorded copies: in batch order (out of the files' mappings: in checkpoint order) where no two
        destinations overlap (as an `ordered` serving assumes), else in the order recorded."""
        if self._ring is not None or not overlapping([c.dst for c in copies]):
            copies = sorted(copies, key=lambda c: (self._batch_of.get(c.region, -1), c.region.order))
        for c in copies:
            c.do(self.box(c.region))
            self._copied_from(c.region)


class AtOnce:
    """Lazy weights served as the consumer asks, in its one run: a copy goes out of the region's file mapping
    straight into its destination (converting as it copies), an op raylazy cannot follow gets a copy of the
    region (read alone where a view cannot show it: sub-byte dtypes). For a checkpoint in the page cache
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
        self.taken[region] += 1
        self.opaque[region] += 1
        box = self._box(region)  # a consumer may write into what it takes: not into the mapping
        return box.clone() if box_mappable(region) else box

    def copy_into(self, dst: torch.Tensor, weight: LazyWeight) -> torch.Tensor:
        self.taken[weight.region] += 1
        self.in_place += weight.region.nbytes if box_mappable(weight.region) else 0
        return Copy(dst, weight.region, weight.lens).do(self._box(weight.region))

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
