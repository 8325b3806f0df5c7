"""Cooperative reads on the CPU: a node's ranks bring its union from storage once, into the page cache (or, on
storage with none to share, into stages in shared memory), and each copies the bytes it keeps out of a memory map.

Every rank of a node gets the node's `NodeSchedule` and a load id (its `NodeRead`). As a keeper, a rank copies
its keeps (`rank_keeps`) out of a private read-only mapping of each file (`mmap`, which shares the page
cache's pages: nothing is read twice from storage) into its shards: one vectorised strided copy per keep,
no per-row system call. Who reads storage depends on `options.stripe_readers`:

- 0 (the default): nobody but the kernel. Each keeper copies all its keeps at once, in stripe order, and
  its page faults read the pages, with the kernel's read-around (large requests; a page another rank of
  the node faulted in is not read again). Measured on CPUs here, this is as fast as naive loading and the
  fastest of the two (docs/cooperative.md); it may read up to a read-around window past the union's edges.
- n > 0: stripe readers. A rank reads its stripes (one contiguous run of the node's union) with n threads
  into the page cache (madvise MADV_POPULATE_READ on a mapping: large requests, exactly the union,
  nothing copied, nothing staged; before Linux 5.14, one read per stripe into a scratch buffer per thread:
  n x stripe_bytes staged), and marks each stripe ready in the node's ready map; a keeper copies a keep as
  soon as its stripe is ready, while its own stripes are still being read.

The rest of this docstring is about stripe readers.

The node's ready map (`raylazy.io.shared.ReadyMap`, a small file in /dev/shm named from the load id and the node)
holds each stripe's state (pending, ready, failed). Every rank of the node creates or opens it; the last rank to
finish (successfully or not) removes it. A rank whose process is killed does not count itself done, so after a
crash the file would be left behind: when such a load fails, the driver has the ranks still alive remove it
(`raylazy.io.shared.remove_ready_maps`). It is never reused (every load has a new id).

A keeper waits at most `options.stripe_timeout_s` for any stripe to become ready (a reader whose process
died and is not restarted in time), then raises a ReadError naming the stripe, its file and its reader.
A reader that fails marks its remaining stripes failed, so its peers fail at once too. Files are
checked against the plan first (FileChangedError); a file truncated while mapped would kill the rank's
process (SIGBUS), which Ray then restarts and the check catches. Only local files sharing a page cache are mapped:
on other storage (objects, a direct_io mount: `NodeRead.staged`) every rank runs `options.threads` stripe readers
that fetch their stripes into the node's stages (`raylazy.io.shared.ReadyMap.stage`: a shared, sparse file per
checkpoint file, in /dev/shm), and keepers copy out of those; a stripe every rank is done with is given back. On
network storage, where a read the storage fails is a SIGBUS to a copy out of a mapping, a keeper reads its keeps with `preadv`
out of the page cache instead (`raylazy.io.ranged.read_part`; on the CPU only), its files not mapped. The
mappings are `raylazy.io.mapping`'s.

On a GPU device the keeps are copied from the mapping to the device one by one (correct, not fast):
the driver's "auto" choice uses cooperative reads for CPU ranks only; the GPU exchange (stripes to the
reader's GPU, then NCCL to the keepers) is a separate path.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from contextvars import copy_context
from itertools import groupby

from ..core.options import ReaderOptions
from ..core.plans import NodeSchedule, RankPlan
from ..core.schedule import NodeRead, rank_keeps, request_runs, run_span
from ..errors import ConfigurationError, ReadError
from ..storage import LocalSource, Source, open_planned_files, reading
from ..storage.verified import check_given_up
from .buffers import shard_buffers, shards_of
from .mapping import mapped_files, populate, populates, unmap_later
from .ranged import gap_bytes, read_part
from .shared import FAILED, READY, ReadyMap
from .stats import Counter, Meter, Progress, ReadStats


def read_rank_cooperative(
    plan: RankPlan,
    device: str = "cpu",
    *,
    node_read: NodeRead,
    options: ReaderOptions = ReaderOptions(),
    on_progress: Progress | None = None,
    out: Mapping | None = None,
    sources: Mapping | None = None,
) -> tuple[dict, ReadStats]:
    """Read `plan`'s shards together with the other ranks of `node_read.schedule`; returns ({name: tensor}, stats).

    Every rank of the node must run this with the same `node_read` at about the same time (each reads stripes the
    others keep). `out` and `sources` as for `raylazy.io.ranged.read_rank_ranged`. Raises on any failure; no
    partial shard is returned.
    """
    import torch

    dev = torch.device(device)
    sched, staged = node_read.schedule, node_read.staged
    if plan.rank not in sched.ranks:
        raise ConfigurationError(f"rank {plan.rank} is not one of node {sched.node}'s ranks {sched.ranks}")
    stats, counter, meter = ReadStats(backend="cooperative", device=str(dev)), Counter(on_progress), Meter()
    buffers = shard_buffers(torch, plan, dev, out)
    keeps = rank_keeps(plan, sched)
    mine = sched.read_by(plan.rank)
    # one request each: runs of adjacent stripes (`request_runs`: a stripe alone but beside a direct block)
    runs = request_runs(sched, plan.rank)
    # this rank's stripe readers (none: the kernel reads); staged, as many as the storage serves requests at once
    threads = min(options.threads if staged else options.stripe_readers, len(runs))
    kept = {k.part.read.file for k in keeps}
    files = (set() if staged else kept) | ({sched.stripes[i].file for i in mine} if threads else set())
    size = max((s.end - s.start for s in (run_span(sched, r) for r in runs)), default=0)
    with ExitStack() as stack:
        # every rank of the node has the same options (the driver gives them one ReaderOptions): all or none use it
        ready = stack.enter_context(_ready_map(node_read.load_id, sched, mine, staged)) \
            if staged or options.stripe_readers else None
        sources = stack.enter_context(open_planned_files(plan, sorted(files), options.storage_options, sources))
        if staged:
            maps = {f: m for f, m in ready.stage(plan).items() if f in kept}
            direct = _direct(sched, plan.rank, keeps, buffers)
        else:
            _check_local(plan, sources)
            if dev.type != "cpu" and not node_read.mapped:
                raise ConfigurationError(f"{plan.files[min(kept)].uri}: on network storage cooperative reads copy out "
                                         "of the page cache with reads, on the CPU only: use backend='exchange'")
            # network storage: read out of the page cache instead (a failed read met through a mapping is a SIGBUS)
            maps = stack.enter_context(mapped_files({f: sources[f] for f in kept} if node_read.mapped else {}))
            direct = {}
        readers = stack.enter_context(_stripe_readers(plan, sched, runs, threads, sources, ready, size, direct))
        with _one_intra_op_thread(torch):
            _keep(plan, sched, keeps, sources, maps, ready, buffers, counter, readers, options.stripe_timeout_s,
                  direct)
        for f in readers:
            f.result()
    stats.bytes_needed = counter.value
    # the rank's share of its node's union as scheduled (the node reads the union once: its readers, or the
    # kernel on the copies' page faults when there are none, whose requests are not the rank's own)
    stats.bytes_read = sum(sched.stripes[i].end - sched.stripes[i].start for i in mine)
    stats.requests = len(runs) if threads else 0
    stats.in_flight, stats.request_bytes = threads, sched.stripe_bytes if threads else 0
    stats.bytes_received = sum(k.part.bytes_needed for k in keeps if sched.stripes[k.stripe].reader != plan.rank)
    # populating the page cache stages nothing; staged, the node's bytes in flight are shared memory, not the rank's
    stats.staging_buffers = threads if not (staged or populates()) else 0
    stats.staging_bytes = stats.staging_buffers * size
    meter.stop(stats)
    return shards_of(plan, buffers), stats


def _direct(sched: NodeSchedule, rank: int, keeps, buffers) -> dict:
    """{stripe: the bytes of the shard it fills}: the node's direct stripes `rank` reads (`NodeSchedule.direct`)
    that are one contiguous keep of its, read straight into the shard (any other is staged as usual). `keeps` are
    in stripe order (`rank_keeps`)."""
    mine, direct = {i for i in sched.direct if sched.stripes[i].reader == rank}, {}
    for i, found in groupby(keeps, key=lambda k: k.stripe):
        (k, *more), s = found, sched.stripes[i]
        (r, first, n), t = k.part, k.tensor
        if i in mine and not more and r.count == 1 and r.offset + first == s.start and n == s.end - s.start:
            direct[i] = buffers[t][0][r.dst_offset + first : r.dst_offset + first + n].numpy()
    return direct


def _check_local(plan: RankPlan, sources: dict[int, Source]) -> None:
    """Only local files can be mapped (the driver reads other storages through the exchange)."""
    for f, source in sources.items():
        if not isinstance(source, LocalSource):
            raise ConfigurationError(f"{plan.files[f].uri}: cooperative reads map local files only: use "
                                     "backend='ranged'")


@contextmanager
def _ready_map(load_id: str, sched: NodeSchedule, mine: tuple[int, ...], staged: bool) -> Iterator[ReadyMap]:
    """The node's ready map for this rank's read: on a failure the rank's stripes not yet ready are marked failed
    (its peers waiting for them fail at once instead of timing out); counted done either way."""
    ready = ReadyMap(load_id, sched, staged)
    try:
        yield ready
    except BaseException:
        ready.fail(mine)
        raise
    finally:
        ready.done()


@contextmanager
def _stripe_readers(plan: RankPlan, sched: NodeSchedule, runs: list[tuple[int, ...]], threads: int, sources: dict,
                    ready: ReadyMap | None, size: int, direct: dict) -> Iterator[list]:
    """`threads` threads reading this rank's stripes, run by run (`_read_stripes`); yields their futures (none
    without threads); on leaving, they stop after their current run (on an error, this rank's stripes not yet
    ready are marked failed first)."""
    if not threads:
        yield []
        return
    stop, todo = threading.Event(), iter(runs)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raylazy-stripe") as pool:
        try:
            yield [pool.submit(copy_context().run, _read_stripes, plan, sched, todo, sources, ready, size, stop,
                               direct)
                   for _ in range(threads)]  # each in the load's context (`raylazy.storage.Load`)
        except BaseException:
            ready.fail(sched.read_by(plan.rank))  # now: the peers stop waiting before a read blocked in the kernel returns
            raise
        finally:
            stop.set()


@contextmanager
def _one_intra_op_thread(torch) -> Iterator[None]:
    """torch's intra-op threads at one while the copies run: the node's ranks already share its cores between
    them, so more threads per rank only oversubscribe them (docs/cooperative.md has the measurements)."""
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(intra_op)


def _read_stripes(plan: RankPlan, sched: NodeSchedule, todo, sources: dict, ready: ReadyMap, size: int,
                  stop: threading.Event, direct: dict) -> None:
    """One reader thread: take the next run of this rank's stripes (shared iterator), bring it whole into the page
    cache (`_populate`, else a read into a scratch buffer of `size` bytes), or staged in one request, each stripe
    into its stage or, a direct one, into the shard (`direct`), mark them ready; repeat until none is left or
    `stop` is set."""
    view = None
    # file -> (mapping, its address): a shared read-only mapping of the reader's own; populating through the
    # keeper's private mapping instead was slower (docs/cooperative.md, "Why no stripe readers by default")
    maps: dict[int, tuple[mmap.mmap, int]] = {}
    try:
        for run in todo:  # next() on a shared list iterator is atomic under the GIL
            if stop.is_set():
                return
            span = run_span(sched, run)
            source, which = sources[span.file], f"stripes {run[0]}-{run[-1]}" if run[1:] else f"stripe {run[0]}"
            with reading(source, f"rank {plan.rank} reading {which} (bytes {span.start}-{span.end})"):
                if ready.staged:  # each stripe into its room in the shard, or in shared memory (taken first)
                    source.readinto(span.start, [direct[i] if i in direct else ready.reserve(sched.stripes[i])
                                                 for i in run])
                elif not populate(source, span, maps):
                    view = view or memoryview(bytearray(size))
                    source.readinto(span.start, [view[: span.end - span.start]])
            for i in run:
                ready.mark(i)
    finally:
        unmap_later(maps)


def _keep(plan: RankPlan, sched: NodeSchedule, keeps, sources: dict, maps: dict, ready: ReadyMap | None, buffers,
          counter, readers: list, timeout_s: float, direct: dict) -> None:
    """Copy every keep into its shard out of its file's mapping (`maps`; with reads from a file not mapped) as soon
    as its stripe is ready (in whatever order stripes become ready; a `direct` stripe was read into the shard);
    with no ready map (no stripe readers), every keep at once, in stripe order."""
    import numpy as np

    gap = gap_bytes(plan)

    def copy(k) -> None:
        f, flat = k.part.read.file, buffers[k.tensor][0]
        if ready is not None and ready.staged:  # out of the stages in shared memory: nothing waits on storage
            if k.stripe not in direct:  # (a direct stripe: this rank's reader read it into the shard)
                _copy_keep(flat, maps[f], k.part)
        else:  # a read in flight while it runs: its page faults may wait on storage
            with reading(sources[f], f"rank {plan.rank} copying {plan.tensors[k.tensor].name!r} out of the page "
                                     f"cache (bytes from {k.part.read.offset})"):
                if f in maps:
                    _copy_keep(flat, maps[f], k.part)
                else:
                    read_part(sources[f], k.part, memoryview(flat.numpy()), 0, gap)
        counter.add(k.part.bytes_needed)

    if ready is None:  # the copies' page faults read the pages, each once for the node (the page cache)
        for k in keeps:
            copy(k)
        return
    by_stripe: dict[int, list] = {}
    for k in keeps:
        by_stripe.setdefault(k.stripe, []).append(k)
    ready.release([i for i in range(len(sched.stripes)) if i not in by_stripe])
    waiting = np.array(sorted(by_stripe), dtype=np.int64)
    deadline, pause = time.monotonic() + timeout_s, 0.0005
    while len(waiting):
        state = ready.flags[waiting]
        if (state == FAILED).any():
            for f in readers:  # this rank's own reader failed: its error says why
                if f.done() and f.exception():
                    f.result()
            i = int(waiting[state == FAILED][0])
            raise ReadError(f"rank {plan.rank}: {_stripe_name(plan, sched, i)} failed on its reader, rank "
                            f"{sched.stripes[i].reader} (see that rank's error)")
        now_ready = waiting[state == READY]
        if not len(now_ready):
            for f in readers:
                if f.done() and f.exception():
                    f.result()
            check_given_up(plan.files[sched.stripes[int(waiting[0])].file].uri)  # a stall gave this read up
            if time.monotonic() > deadline:
                i = int(waiting[0])
                raise ReadError(f"rank {plan.rank}: {_stripe_name(plan, sched, i)} was not ready within "
                                f"{timeout_s:.0f} s: its reader, rank {sched.stripes[i].reader}, died or is stuck")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
            continue
        for i in now_ready.tolist():
            for k in by_stripe[i]:
                copy(k)
            ready.release([i])
        waiting = waiting[state != READY]
        deadline, pause = time.monotonic() + timeout_s, 0.0005


def _copy_keep(flat, src, part) -> None:
    """Copy one keep: bytes [first, first + n) of a contiguous read, or rows [first, first + n) of a strided one."""
    r, first, n = part
    if r.count == 1:
        a, d = r.offset + first, r.dst_offset + first
        flat[d : d + n].copy_(src[a : a + n])
        return
    a, d = r.offset + first * r.stride, r.dst_offset + first * r.dst_stride
    rows = (n, r.length)
    flat[d:].as_strided(rows, (r.dst_stride, 1)).copy_(src[a:].as_strided(rows, (r.stride, 1)))


def _stripe_name(plan: RankPlan, sched: NodeSchedule, i: int) -> str:
    s = sched.stripes[i]
    return f"stripe {i} (bytes {s.start}-{s.end} of {plan.files[s.file].uri})"
