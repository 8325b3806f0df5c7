"""A rank group reads a plan from storage: each rank's backend chosen, the node schedules and tasks made, the
reads called on the actors and followed (progress bar), failures gathered by rank (`RankGroup.gather`)."""

from __future__ import annotations

import sys
import time
import uuid

from ..core.options import LoadOptions, ReaderOptions
from ..core.plans import Plan
from ..core.schedule import NodeTask, group_by_node, with_node_schedules
from ..io.backends import NODE_BACKENDS, backend_for
from ..io.stats import ReadStats
from .group import RankGroup


def read_ranks(group: RankGroup, plan: Plan, opts: LoadOptions, method: str) -> tuple[Plan, list[ReadStats]]:
    """The ranks of `plan` (the group's first ranks) read their shards from storage: each rank's backend chosen,
    the node schedules and tasks made, then `method` ("load": new shards, "reload": into the shards held) called
    on each; returns the plan as read (with its node schedules, for node backends) and their ReadStats."""
    ranks = group.ranks[: len(plan.ranks)]
    nodes = group_by_node([r.node_id for r in ranks])
    readers = [rank_reader(opts.reader, len(nodes.peers(r.rank)), r.device, plan.files) for r in ranks]
    if any(r.backend in NODE_BACKENDS for r in readers):
        plan = with_node_schedules(plan, nodes.node_of, opts.reader.stripe_bytes)
    tasks = node_tasks(group, plan, readers, opts.timeout_s)
    calls = [getattr(a, method).remote(rp, reader, task)
             for a, rp, reader, task in zip(group.actors, plan.ranks, readers, tasks)]
    try:
        return plan, wait_with_progress(group, calls, plan, opts, method)
    except BaseException:
        if opts.reader.stripe_readers:  # only stripe readers keep a ready map
            _forget_ready_maps(group, tasks)
        raise


def _forget_ready_maps(group: RankGroup, tasks: list) -> None:
    """After a failed cooperative read, the ranks still alive remove their node's ready map (a rank that died
    never counted itself done, so the file would stay in /dev/shm); best effort, a few seconds at most."""
    import ray

    coop = {t.load_id for t in tasks if isinstance(t, NodeTask)}
    calls = [a.forget_load.remote(load_id) for a in group.actors for load_id in coop]
    if calls:
        ray.wait(calls, num_returns=len(calls), timeout=5)


def rank_reader(reader: ReaderOptions, ranks_on_node: int, device: str = "cpu", files: tuple = ()) -> ReaderOptions:
    """The rank's reader options: its backend chosen (`backend_for`); fastsafetensors with nogds=None: a rank
    sharing its node with other ranks must not use GDS."""
    reader = reader.model_copy(update={"backend": backend_for(reader.backend, ranks_on_node, device, files)})
    if reader.backend == "fastsafetensors" and reader.nogds is None and ranks_on_node > 1:
        return reader.model_copy(update={"nogds": True})
    return reader


def node_tasks(group: RankGroup, plan: Plan, readers: list, timeout_s: float) -> list:
    """Per rank, what it needs to read with its node: a NodeTask (cooperative: one load id for the node's
    ready map), an ExchangeTask (exchange: the node's schedule, rank plans and meeting address, asked of the
    node's first rank), or None (a rank reading alone)."""
    from ..io.exchange import ExchangeTask

    load_id = uuid.uuid4().hex[:16]
    meet = sorted({plan.node_of(r).ranks[0] for r, rd in enumerate(readers) if rd.backend == "exchange"})
    addresses = dict(zip(meet, group.gather([group.actors[r].exchange_address.remote() for r in meet],
                                            timeout_s, "exchange address")))
    tasks = []
    for rank, reader in enumerate(readers):
        sched = plan.node_of(rank) if reader.backend in NODE_BACKENDS else None
        tasks.append(NodeTask(load_id, sched) if reader.backend == "cooperative"
                     else ExchangeTask.of(plan, sched, addresses[sched.ranks[0]]) if reader.backend == "exchange"
                     else None)
    return tasks


def wait_with_progress(group: RankGroup, loads: list, plan: Plan, opts: LoadOptions, what: str) -> list[ReadStats]:
    """Gather the ranks' reads (`group.gather`; a failure is one RankFailedError saying `what` failed: "load" or
    "reload"), with a progress bar of the bytes they report when asked for (`opts.progress`; default: when
    stderr is a terminal)."""
    import ray

    show = opts.progress if opts.progress is not None else sys.stderr.isatty()
    if not show:
        return group.gather(loads, opts.timeout_s, what)
    from tqdm import tqdm

    total = sum(r.stats.bytes_needed for r in plan.ranks)
    start = time.monotonic()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"raylazy tp={plan.tp}", file=sys.stderr) as bar:
        while time.monotonic() - start < opts.timeout_s:
            ready, _ = ray.wait(loads, num_returns=len(loads), timeout=0.25)
            try:
                done = sum(ray.get([a.progress.remote() for a in group.actors], timeout=5))
            except Exception:  # noqa: BLE001  (a dead rank: gather reports it below)
                break
            bar.update(done - bar.n)  # the ranks' own count, also after the last load: the bar is never forced full
            if len(ready) == len(loads):
                break
        stats = group.gather(loads, max(0.0, opts.timeout_s - (time.monotonic() - start)), what)
    return stats
