"""Execute one rank's plan with positional reads straight into its shard tensors.

The rank's schedule (`raylazy.core.schedule`) cuts each shard into windows of whole destination rows (at most
`chunk_bytes`, or one row if a row is larger). A thread pool reads windows concurrently through the files'
`Source`s (`raylazy.storage`: `os.preadv` locally), each row range landing in place: `threads` threads, or more
where a source serves more reads at once (its `concurrency`: object storage's GETs in flight). A window's rows
are asked of storage all at once (see `_read_rows`), so a cold read does not wait on storage once per row.
On the CPU a window is a slice of the shard itself, so nothing is staged. On a GPU a window is read into one of
`queue_size + 2` pinned staging buffers and copied to the device asynchronously while the next windows are read:
staging never exceeds (queue_size + 2) x window bytes, and no more windows are in flight (from object storage,
raise `queue_size` for more GETs at once).
"""

from __future__ import annotations

import os
import queue
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextvars import copy_context

from ..core.options import ReaderOptions
from ..core.plans import RankPlan, Read
from ..core.schedule import RankSchedule, Window, rank_schedule
from ..storage import Source, open_planned_files, reading, requested
from .buffers import plan_files, shard_buffers, shards_of
from .stats import Counter, Meter, Progress, ReadStats

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_rank_ranged(
    plan: RankPlan,
    device: str = "cpu",
    *,
    options: ReaderOptions = ReaderOptions(),
    on_progress: Progress | None = None,
    stage: bool | None = None,
    schedule: RankSchedule | None = None,
    out: Mapping | None = None,
    sources: Mapping | None = None,
) -> tuple[dict, ReadStats]:
    """Read `plan`'s shards onto `device`; returns ({name: tensor}, stats). Raises on any failure.

    `out` ({name: tensor}) gives shards to fill in place (and return): each must match its
    shard (see `raylazy.io.buffers.shard_buffers`); the others are allocated. `sources`: files already open
    and checked (`raylazy.storage.open_planned_files`'s `opened`).

    `schedule` is the plan's windows (default: `rank_schedule(plan, options.chunk_bytes)`).
    Staging keeps options.queue_size + 2 windows of host memory (-1: one, fully serial).
    `stage` forces (True) or avoids (False) the staging-buffer pipeline; by default
    only non-CPU devices stage.
    """
    import torch

    dev = torch.device(device)
    stats, counter, meter = ReadStats(backend="ranged", device=str(dev)), Counter(on_progress), Meter()
    buffers = shard_buffers(torch, plan, dev, out)
    flats = [flat for flat, _ in buffers]
    schedule = schedule or rank_schedule(plan, options.chunk_bytes)
    with open_planned_files(plan, plan_files(plan), options.storage_options, sources) as sources:  # read-ahead off
        reader = _Reader(plan, sources, counter)
        threads = max([options.threads] + [s.concurrency for s in sources.values()])
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raylazy-read") as pool:
            if dev.type != "cpu" if stage is None else stage:
                stats.staging_buffers = _staged(torch, pool, reader, schedule, flats, dev, options.queue_size + 2)
                stats.staging_bytes = stats.staging_buffers * schedule.window_bytes
            else:
                _in_place(pool, reader, schedule, flats)
    stats.bytes_needed = counter.value
    stats.bytes_read = sum(t.bytes_read for t in plan.tensors)
    stats.requests = sum(t.requests for t in plan.tensors)
    stats.in_flight, stats.request_bytes = threads, schedule.window_bytes
    meter.stop(stats)
    return shards_of(plan, buffers), stats


def _in_place(pool, reader: _Reader, schedule: RankSchedule, flats) -> None:
    """CPU path: every window read straight into its slice of the shard; the first failure cancels the rest."""
    futures = [pool.submit(copy_context().run, reader.run, w, _as_view(flats[w.tensor], w.start, w.end))
               for w in schedule.windows]  # each in the load's context (`raylazy.storage.Load`)
    try:
        for f in futures:
            f.result()
    except BaseException:
        for f in futures:  # stop at the first failure: no half-read shard is returned
            f.cancel()
        raise


def _as_view(flat, start: int, end: int) -> memoryview:
    return memoryview(flat.numpy()).cast("B")[start:end]


class _Reader:
    """Runs jobs: positional reads from the planned files into a window's buffer."""

    def __init__(self, plan: RankPlan, sources: dict[int, Source], counter: Counter):
        self.plan, self.sources, self.counter = plan, sources, counter
        self.gap = gap_bytes(plan)

    def run(self, job: Window, buf: memoryview) -> None:
        name = self.plan.tensors[job.tensor].name
        for r, first, n in job.parts:  # whole ranges asked for at once (a read alone waits on each read-ahead window)
            if r.count == 1:
                with requested(self.sources[r.file], f"asking for tensor {name!r}'s bytes ahead"):
                    self.sources[r.file].will_need(r.offset + first, r.offset + first + n)
        for part in job.parts:
            source = self.sources[part.read.file]
            with reading(source, f"reading tensor {name!r} at byte {part.read.offset}"):
                read_part(source, part, buf, job.start, self.gap)
        self.counter.add(job.bytes_needed)


def read_part(source: Source, part, buf: memoryview, base: int, gap: bytearray) -> None:
    """One part of a read (`raylazy.core.schedule`'s (read, first, n)) from `source` into `buf`, which starts at
    shard byte `base`: bytes [first, first + n) of a contiguous read, else its rows [first, first + n). `gap`: room
    for the bytes between rows that a gathered read (`Read.gather`) reads along with them."""
    r, first, n = part
    if r.count == 1:
        dst = r.dst_offset + first - base
        source.readinto(r.offset + first, [buf[dst : dst + n]])
    elif r.gather:
        _gather(source, r, first, n, buf, base, memoryview(gap)[: r.stride - r.length])
    else:
        _read_rows(source, r, first, n, buf, base)


def gap_bytes(plan: RankPlan) -> bytearray:
    """Room for the largest gap between the rows of any of `plan`'s gathered reads (`read_part`)."""
    return bytearray(max([r.stride - r.length for t in plan.tensors for r in t.reads if r.gather] or [0]))


def _gather(source: Source, r: Read, first: int, n: int, buf: memoryview, base: int, gap: memoryview) -> None:
    iov = []  # rows and the gaps between them: one range (object storage fetches it in concurrent parts)
    for i in range(first, first + n):
        dst = r.dst_offset + i * r.dst_stride - base
        iov.append(buf[dst : dst + r.length])
        if i != first + n - 1 and len(gap):
            iov.append(gap)
    source.readinto(r.offset + first * r.stride, iov)


def _read_rows(source: Source, r: Read, first: int, n: int, buf: memoryview, base: int) -> None:
    """Rows first .. first+n-1 of `r`, one read each, into `buf` (which starts at shard byte `base`).

    From a cold cache, row after row would each wait on storage in turn. So the first row is
    tried without waiting (`try_readinto`, RWF_NOWAIT locally): if it was cached, every row is
    tried that way, the cached ones copied at once while the kernel starts reading exactly the
    pages of the others (then read waiting); if not, the pages of all the rows are asked for at
    once (`will_need`, in runs of rows whose pages touch, so no page no row needs) and the rows
    are then read waiting. Either way storage sees many requests at once, and only the rows'
    own pages.
    """
    todo = []  # (view, file offset) still to read, waiting
    warm = None
    try_read = source.try_readinto
    for i in range(first, first + n):
        dst = r.dst_offset + i * r.dst_stride - base
        view, off = buf[dst : dst + r.length], r.offset + i * r.stride
        if warm is not False:
            got = try_read(off, view)
            warm = warm or got == r.length
            if got < r.length:
                todo.append((view[got:], off + got))
        else:
            todo.append((view, off))
    if not warm:
        start = end = -1
        for view, off in todo:
            if start >= 0 and off // _PAGE <= (end - 1) // _PAGE + 1:
                end = off + len(view)
                continue
            if start >= 0:
                source.will_need(start, end)
            start, end = off, off + len(view)
        if start >= 0:
            source.will_need(start, end)
    for view, off in todo:
        if len(view):
            source.readinto(off, [view])


def _staged(torch, pool, reader: _Reader, schedule: RankSchedule, flats, dev, depth: int) -> int:
    """GPU path: read windows into `depth` pinned buffers, copy each to the device while others read;
    returns the number of buffers."""
    size = schedule.window_bytes
    depth = max(1, depth)
    free: queue.Queue = queue.Queue()
    for _ in range(depth):
        free.put(torch.empty(size, dtype=torch.uint8, pin_memory=dev.type == "cuda"))
    stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
    in_flight: list = []  # (event, buffer) of copies not yet known to be done

    def fill(job):
        buf = free.get()
        if buf is None:  # the load was aborted while this job waited for a buffer
            return job, None
        if job.padded:
            buf[: job.end - job.start].zero_()
        reader.run(job, _as_view(buf, 0, job.end - job.start))
        return job, buf

    pending = {pool.submit(copy_context().run, fill, w) for w in schedule.windows}
    try:
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                job, buf = f.result()
                in_flight.append((_copy_to_device(torch, stream, flats[job.tensor][job.start : job.end], buf), buf))
                while in_flight and (in_flight[0][0] is None or in_flight[0][0].query() or free.empty()):
                    event, done_buf = in_flight.pop(0)
                    if event is not None:
                        event.synchronize()
                    free.put(done_buf)
    except BaseException:
        for f in pending:
            f.cancel()
        for _ in range(len(pending)):  # wake jobs blocked on a buffer so the pool can shut down
            free.put(None)
        raise
    if stream is not None:
        stream.synchronize()
    return depth


def _copy_to_device(torch, stream, dst, buf):
    """Copy the filled part of a staging buffer to `dst`; on CUDA asynchronously, returning its event."""
    if stream is None:
        dst.copy_(buf[: dst.numel()])
        return None
    with torch.cuda.stream(stream):
        dst.copy_(buf[: dst.numel()], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event
