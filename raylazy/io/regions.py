"""Regions of one checkpoint (`raylazy.core.boxes.Region`: a box of a tensor) read with raylazy's readers:
`RegionReader` holds the files open for a load, checked once, reads regions alone or as one process's part of a
node's read (each region one shard of a rank plan, its box read exactly; whole tensors for fastsafetensors, the
regions cut from them), and shows a region as a view of its file's mapping (`raylazy.io.mapping`), or, for a
checkpoint taken from a holder (`raylazy.io.held`), serves its files out of the holder's chunks and nothing from
storage; `opened` opens it on every process of a load and gathers their outcomes before any collective."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack

import torch

from ..core.boxes import Region, gathering
from ..core.checkpoint import Checkpoint
from ..core.choices import BackendChoice, alone_backend, choose_backend, maps_safely
from ..core.mesh import Mesh
from ..core.options import ServingOptions
from ..core.plans import FileRef, Plan, RankPlan
from ..core.schedule import NodeRead
from ..errors import first_line
from ..storage import open_planned_files, storage_for
from .backends import read_rank
from .collective import Exchange
from .held import Held
from .mapping import cached_share, mapped, mapped_box, unmap_later
from .nodes import NodeGroup, shares_page_cache
from .stats import ServingStats

#: The share of each file's pages in the page cache from which a checkpoint counts as there (`RegionReader.warm`):
#: the few pages a proactive reclaim took meanwhile (some virtual machines run one) the copies' faults read again.
WARM_SHARE = 0.9


class RegionReader:
    """Regions of one checkpoint read with raylazy's readers (a context manager: it holds the files open), every
    read counted in `stats`; `held`: the checkpoint's bytes taken from a holder, read instead of its files."""

    def __init__(self, ckpt: Checkpoint, options: ServingOptions, held: Held | None = None):
        storage = storage_for(ckpt.root, options.reader.storage_options)
        # a holder's bytes are memory: its storage is not asked what it is (a mount would be probed for nothing)
        self.storage = None if held else storage.kind(ckpt.root)
        costs = None if held else storage.cost_model(ckpt.root, self.storage)
        self.ckpt, self.options = ckpt, options.model_copy(update={"reader": options.reader.shaped(costs)})
        self.files = tuple(map(FileRef.of, ckpt.files))
        self.held = held
        self.stats = ServingStats(storage="holder" if held else self.storage.name if self.storage else "")
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
        self.held = None  # the holder's objects are let go

    def sources(self, files) -> dict[int, object]:
        """The files, opened and checked against the checkpoint's headers the first time one is asked for."""
        with self._lock:
            if self.held is not None:
                return {f: self.held.source(f) for f in files}
            if new := [f for f in files if f not in self._sources]:
                self._sources.update(self._open.enter_context(open_planned_files(
                    self._none, new, self.options.reader.storage_options)))
            return {f: self._sources[f] for f in files}

    def mapping(self, file: int) -> torch.Tensor:
        """File `file` as a uint8 tensor over a mapping of it (`raylazy.io.mapping.mapped`), made once."""
        m = self._maps.get(file)
        return m if m is not None else self._maps.setdefault(file, mapped(self.sources([file])[file]))

    def mapped_box(self, region: Region) -> torch.Tensor:
        """The region's box as a view of its file's mapping, or of the holder's chunk (only for a region
        `box_mappable` says a view shows)."""
        return self.held.box(region) if self.held is not None else mapped_box(self.mapping(region.file), region)

    def copies_at_once(self) -> bool:
        """Whether a load copies out of memory at once (`AtOnce`): out of a holder's chunks, or where the options
        allow it (`warm_copies`, a backend that copies out of the files' mappings: `choice`) out of the page cache,
        where the checkpoint is there (`warm`)."""
        return self.held is not None or (
            self.options.warm_copies and self.choice(1, "cpu").backend == "cooperative" and self.warm())

    @property
    def copied_from(self) -> str:
        """Where a load copying at once copies out of (for its log line; still known once the reader is left)."""
        return "out of its holder's objects" if self.stats.storage == "holder" else "the checkpoint in the page cache"

    def warm(self) -> bool:
        """Whether the checkpoint is in the page cache: local files whose pages a mapping shares, each at least
        `WARM_SHARE` there (`raylazy.io.mapping.cached_share`, a sample; the files are mapped to ask, and the
        first one short of it ends the asking)."""
        return shares_page_cache(self.files, self.storage) and all(
            cached_share(m.data_ptr(), m.numel()) >= WARM_SHARE for m in map(self.mapping, range(len(self.files))))

    def shard(self, region: Region, name: str):
        """The plan entry reading `region`."""
        return region.shard(name, self._gather, self.ckpt.files[region.file].path)

    def rank_plan(self, rank: int, regions: list[Region], mesh: Mesh = Mesh()) -> RankPlan:
        """Rank `rank`'s plan for `regions`: one shard each, named after its tensor and box."""
        return RankPlan(rank=rank, mesh=mesh, files=self.files, tensors=tuple(self.shard(r, _name(r)) for r in regions))

    def plan(self, regions: list[list[Region]]) -> Plan:
        """A plan of one rank per list of `regions` (the processes of a node reading them together)."""
        mesh = Mesh(tp=len(regions))
        return Plan(root=self.ckpt.root, model_type=self.ckpt.config.model_type, mesh=mesh,
                    max_gap=self.options.max_gap, uneven="error", checkpoint_bytes=self.ckpt.nbytes, files=self.files,
                    skipped=(), ranks=tuple(self.rank_plan(i, r, mesh) for i, r in enumerate(regions)))

    def choice(self, peers: int, device: str) -> BackendChoice:
        """The backend a process with `peers` processes on its node (itself included) serves regions with: copying
        out of the files' mappings where it can and they cannot fail (`raylazy.core.choices.choose_backend`)."""
        reader = self.options.reader
        return choose_backend(reader.backend, peers, device, shares_page_cache(self.files, self.storage), reader.nogds,
                              copies_out=True, mappable=maps_safely(self.storage))

    def read(self, regions: list[Region], *, backend: str = "ranged", device: str = "cpu", out: dict | None = None,
             plan: RankPlan | None = None, node_read: NodeRead | None = None,
             exchange: Exchange | None = None) -> dict[Region, torch.Tensor]:
        """Each region's box as a tensor on `device`: read alone with `backend`, or as this process's part (`plan`)
        of a node read (`exchange`: the node's, open across batches). A holder's chunks are copied by the ranged
        reader, whatever the backend: they are memory, not files to open."""
        backend = "ranged" if self.held is not None else backend
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
        return self.read([region], backend=alone_backend(self.options.reader.backend))[region]


def opened(ckpt: Callable[[], Checkpoint], options: ServingOptions, group: NodeGroup | None, mine: Callable,
           failure: Callable, take: Callable[[Checkpoint], Held | None] = lambda ckpt: None) -> tuple[RegionReader, list]:
    """The checkpoint (`ckpt()`) opened on this worker, every file checked against its header (or its bytes taken
    from a holder: `take(checkpoint)`, None where none serves it), then every worker's
    outcome gathered in one gathering before any other collective of the load, so that a worker that failed never
    leaves the others waiting in one: (the reader, every worker's `mine(reader)`). Where one failed, every worker
    raises `failure(worker, why, this worker's error or None)`, the reader closed."""
    reads = error = got = None
    try:
        checkpoint = ckpt()
        reads = RegionReader(checkpoint, options, take(checkpoint))
        reads.sources(range(len(reads.ckpt.files)))
        got = mine(reads)
    except Exception as e:  # noqa: BLE001  (raised below, on every worker)
        error = e
    why = error and f"{type(error).__name__}: {first_line(error)}"
    told = group.gather((why, got))() if group else [(why, got)]
    failed = next(((r, w) for r, (w, _) in enumerate(told) if w), None)
    if failed:
        if reads is not None:
            reads.__exit__(None, None, None)
        raised = failure(*failed, error)
        if raised is error:
            raise error
        raise raised from error
    return reads, [m for _, m in told]


def _name(region: Region) -> str:
    box = ",".join(f"{a}:{a + n}" for a, n in zip(region.starts, region.sizes))
    return f"{region.tensor.name}[{box}]"
