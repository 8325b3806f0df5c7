"""A load on the driver, start to finish: `Load` owns the rank group, the options, whether the ranks fill new
shards or the ones they hold (a reload) and the one deadline of every step after placement. Its steps, in
`Load.run`: plan, wait until the ranks are placed and started, replica 0's ranks read from storage (each with its
backend, and its node's `NodeRead` where it reads with its node), the other replicas copy from a live replica
(`raylazy.cluster.receive` in the receiving rank), and ranks whose copy failed read from storage instead."""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from ..core.choices import choose_transport
from ..core.mesh import Coord, Mesh
from ..core.options import LoadOptions, ReaderOptions
from ..core.planner import with_replicas
from ..core.plans import Plan, check_same_layout
from ..core.rules import RulesLike
from ..core.schedule import NodeRead
from ..errors import ConfigurationError, PeerFailedError, RankFailedError, StaleHolderError, first_line
from ..io.backends import check_backend
from ..io.nodes import node_reads
from ..io.stats import ReadStats
from ..planning import make_plan
from ..storage import identity, storage_for
from .actor import RankLoader
from .bundles import check_placeable, rank_bundles, stage_strategy
from .group import Deadline, RankGroup, cause
from .holder import HeldModel

log = logging.getLogger("raylazy")

#: How a rank may copy its shards from a live replica's rank (`LoadOptions.peer_transport`).
PEER_TRANSPORTS = ("object_store", "nccl", "gloo")


class Load:
    """One load (new shards) or reload (`held`: the plan of the shards the ranks hold, filled in place) by `group`
    with `options`. `deadline` (`options.timeout_s`) starts once the group is placed and bounds every step after.

    `Load.start` makes the group of a new load; `run` does the steps and returns the plan as read (with replica 0's
    node schedules, if any) and every rank's ReadStats."""

    def __init__(self, group: RankGroup, options: LoadOptions, held: Plan | None = None):
        self.group, self.options, self.held = group, options, held
        self.deadline: Deadline | None = None  # set once the ranks are placed
        #: Seconds of each step `run` took: plan, ready (the ranks placed and started, after planning), read, copy.
        self.phases: dict[str, float] = {}

    @property
    def what(self) -> str:
        """What a failure says failed."""
        return "load" if self.held is None else "reload"

    @classmethod
    def start(cls, options: LoadOptions, own_ray: bool, actor_cls: type = RankLoader,
              actors: list | None = None) -> Load:
        """A new load's group: the caller's `actors` made ranks, else one bundle per rank (a placement group per
        pipeline stage of each replica), checked against the cluster first, its `actor_cls` actors starting
        (importing torch) while the driver plans."""
        place, mesh = options.placement, options.plan.mesh
        if actors is not None:
            if actor_cls is not RankLoader:
                raise ConfigurationError("give actors= (your own rank actors) or actor_cls= (the class raylazy "
                                         "starts), not both")
            if len(actors) != mesh.size:
                raise ConfigurationError(f"actors= gives {len(actors)} actor(s) for {mesh.size} rank(s): "
                                         "give one per rank")
            group = RankGroup.adopt(actors, place.device)
        else:
            bundles = rank_bundles(mesh.size, place, own_ray)
            groups = mesh.size // mesh.tp if mesh.pp > 1 else 1
            strategy = stage_strategy(bundles, place, groups)
            check_placeable(bundles, strategy, place.autoscale, groups)
            group = RankGroup.create(bundles, place.device, strategy, place.max_retries, actor_cls, groups)
        return cls(group, options)

    def run(self, model_dir: str | os.PathLike | None, rules: RulesLike | None = None,
            source=None) -> tuple[Plan, list[ReadStats]]:
        """Plan `model_dir` with `rules` (or copy `source`'s plan: a live LoadedModel every rank copies from), wait
        until the ranks are ready, read replica 0 from storage, copy the others; a failure releases the group of
        a new load (a reload keeps its ranks: those that did not fail hold the new checkpoint)."""
        try:
            with self._timed("plan"):
                plan = self._plan(model_dir, rules, source)
            with self._timed("ready"):
                self._ready()
            read = []
            if source is None:
                with self._timed("read"):
                    plan, read = self._read(plan)
            elif isinstance(source, HeldModel):
                with self._timed("take"):
                    read = self._take(plan, source)
            with self._timed("copy"):
                stats = self._copy(plan, read, source)
            for s in stats:  # every rank's reader read (or its source read) the plan's storage
                s.storage = plan.storage.name if plan.storage else ""
            return plan, stats
        except BaseException:
            if self.held is None:
                self.group.release()
            raise

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = time.perf_counter() - t0

    def _plan(self, model_dir, rules: RulesLike | None, source) -> Plan:
        """The plan, from headers, checked for the backend and a reload's layout (before any byte is written)."""
        opts, planning = self.options, dict(self.options.plan)
        if isinstance(source, HeldModel) and planning["max_gap"] is None:
            planning["max_gap"] = 0  # copied out of memory: no gap is worth copying to save a request
        plan = (with_replicas(source.plan, opts.plan.mesh.dp) if source is not None and not isinstance(source, HeldModel)
                else make_plan(model_dir, rules=rules, storage_options=opts.reader.storage_options,
                               request_timeout_s=opts.reader.request_timeout_s, **planning))
        check_backend(opts.reader.backend, plan.ranks)
        if self.held is not None:
            check_same_layout(self.held, plan)
        return plan

    def _ready(self) -> None:
        """Wait for a new load's placement, then start the deadline and ask every rank where it runs (a rank Ray
        restarted since the last load may be on another node now)."""
        if self.held is None:
            self.group.wait_placed(self.options.placement.placement_timeout_s)
        self.deadline = Deadline(self.options.timeout_s)
        self.group.refresh(self.deadline, "start" if self.held is None else self.what)

    def _read(self, plan: Plan) -> tuple[Plan, list[ReadStats]]:
        """Replica 0's ranks read their shards from storage as the node-read driver says (`raylazy.io.nodes`: each
        with its backend and, reading with its node, the node's NodeRead); returns the plan with their nodes'
        schedules and their ReadStats."""
        import ray

        ranks = self.group.ranks[: plan.mesh.size // plan.mesh.dp]
        load_id = uuid.uuid4().hex[:16]
        plan, reads = node_reads(plan, [r.node_id for r in ranks], [r.device for r in ranks], self._reader(plan),
                                 load_id, self._meeting)
        shared = {id(r.node_read): ray.put(r.node_read) for r in reads if r.node_read is not None}  # once a node
        calls = [self._read_call(i, plan, r.reader, shared.get(id(r.node_read))) for i, r in enumerate(reads)]
        try:
            return plan, self._wait_reads(calls, plan)
        except BaseException:
            # cooperative ranks that died never counted themselves done: the ranks alive remove the node's ready
            # map and stages (from /dev/shm); best effort, a few seconds at most
            if plan.nodes:
                forgot = [a.forget_load.remote(load_id) for a in self.group.actors]
                ray.wait(forgot, num_returns=len(forgot), timeout=5)
            raise

    def _reader(self, plan: Plan) -> ReaderOptions:
        """The reader options with the reads shaped for the storage the plan's files are on."""
        reader = self.options.reader
        return reader.shaped(storage_for(plan.root, reader.storage_options).cost_model(plan.root, plan.storage))

    def _meeting(self, ranks: list[int]) -> list[str]:
        """The exchange's meeting addresses of `ranks` (each its node's first), asked of them."""
        return self.group.gather([self.group.actors[r].exchange_address.remote() for r in ranks], self.deadline,
                                 "exchange address")

    def _read_call(self, rank: int, plan: Plan, reader: ReaderOptions, read: NodeRead | None = None):
        """Rank `rank` reads its plan: into new shards (`load`) or the ones it holds (`reload`)."""
        actor = self.group.actors[rank]
        return (actor.load if self.held is None else actor.reload).remote(plan.ranks[rank], reader, read)

    def _wait_reads(self, calls: list, plan: Plan) -> list[ReadStats]:
        """Gather the ranks' reads within the deadline (a failure is one RankFailedError), with a progress bar of
        the bytes they report when asked for (`options.progress`; default: when stderr is a terminal)."""
        import ray

        show = self.options.progress if self.options.progress is not None else sys.stderr.isatty()
        if not show:
            return self.group.gather(calls, self.deadline, self.what)
        from tqdm import tqdm

        with tqdm(total=sum(p.stats.bytes_needed for p in plan.ranks[:len(calls)]), unit="B", unit_scale=True,
                  desc=f"raylazy tp={plan.tp}", file=sys.stderr) as bar:
            while self.deadline.left():
                ready, _ = ray.wait(calls, num_returns=len(calls), timeout=min(0.25, self.deadline.left()))
                try:
                    done = sum(ray.get([a.progress.remote() for a in self.group.actors], timeout=5))
                except Exception:  # noqa: BLE001  (a dead rank: gather reports it below)
                    break
                bar.update(done - bar.n)  # the ranks' own count, also after the last read: the bar is never forced full
                if len(ready) == len(calls):
                    break
            return self.group.gather(calls, self.deadline, self.what)

    def _take(self, plan: Plan, held: HeldModel) -> list[ReadStats]:
        """Every rank copies its shards out of the holder on its node (`RankMixin.take`), the checkpoint checked to be
        the one held first (a StaleHolderError, before any rank starts, where it changed); ranks whose take fails
        (the holder died or was released) read from storage instead. Returns every rank's ReadStats."""
        now = identity(plan.files)
        if now != held.identity:
            raise StaleHolderError(f"{held.root}: its holders keep it as it was when held (identity {held.identity}), "
                                   f"but it is {now} on storage now: hold it again (raylazy.hold) or load from storage")
        refs = {r: a.take.remote(held.root, now, plan.ranks[r], self.options.reader, self.deadline.left(),
                                 self.held is not None) for r, a in enumerate(self.group.actors)}
        return self._settled(plan, refs, {}, lambda failed: sorted(failed), "a holder")

    def _copy(self, plan: Plan, read: list[ReadStats], source) -> list[ReadStats]:
        """The ranks after those that `read` from storage copy their shards from a live replica's rank with their
        coordinates (in `source`, a live LoadedModel, else in replica 0), into the shards they hold for a reload;
        those whose copy fails read from storage instead. Returns every rank's ReadStats."""
        first = len(read)
        ranks = range(first, plan.mesh.size)
        if not ranks:
            return read
        feeding = source.group if source is not None else self.group
        src_mesh, src_replicas = (source.plan.mesh, source.plan.mesh.dp) if source is not None else (plan.mesh, 1)
        feeds = [source_rank(src_mesh, plan.mesh.coord(r), src_replicas) for r in ranks]
        devices = {feeding.ranks[s].device for s in feeds} | {self.group.ranks[r].device for r in ranks}
        transport = choose_transport(self.options.peer_transport,
                                     "cuda" if all(d.startswith("cuda") for d in devices) else "cpu",
                                     {"cpu": "object_store", "cuda": "nccl"}, "peer_transport", PEER_TRANSPORTS)
        refs = {r: self.group.actors[r].receive.remote(feeding.actors[s], plan.ranks[r], self.options.reader, transport,
                                                       self.held is not None) for r, s in zip(ranks, feeds)}
        # in this load, a source that died lost its shards too (a restarted actor holds none): it reads again
        return self._settled(plan, refs, dict(enumerate(read)), lambda failed: sorted(
            set(failed) | ({feeds[r - first] for r in failed} if source is None else set())), "a live replica")

    def _settled(self, plan: Plan, refs: dict, stats: dict, again, source: str) -> list[ReadStats]:
        """Every rank's ReadStats (`stats`, and those of the copies `refs` from `source`), once the copies are done
        within the deadline: the ranks `again(failed)` says read from storage instead where copies failed."""
        import ray

        _, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.deadline.left())
        if late:
            raise RankFailedError({r: self.deadline.missed(f"copying shards from {source}")
                                   for r, ref in refs.items() if ref in late}, self.what)
        failed = {}
        for r, ref in refs.items():
            try:
                stats[r] = ray.get(ref)
            except Exception as e:  # noqa: BLE001  (a failed copy: read from storage instead)
                failed[r] = cause(e)
        if failed:
            stats.update(self._read_instead(plan, again(failed), failed, source))
        return [stats[r] for r in range(plan.mesh.size)]

    def _read_instead(self, plan: Plan, ranks: list[int], failed: dict, source: str) -> dict:
        """Ranks whose copy from `source` failed read their shards from storage, each alone; when that fails
        too (the checkpoint is gone), one PeerFailedError naming both causes. Returns rank -> ReadStats."""
        first = next(iter(failed.values()))
        log.warning("raylazy: rank(s) %s could not copy their shards from %s (%s); reading rank(s) %s "
                    "from storage (%s) instead", ",".join(map(str, failed)), source, first, ",".join(map(str, ranks)),
                    plan.root)
        try:  # without a NodeRead each rank reads alone (`read_rank`: node backends read ranged)
            reader = self._reader(plan)
            stats = self.group.gather([self._read_call(r, plan, reader) for r in ranks], self.deadline,
                                      f"{self.what} from storage")
        except RankFailedError as e:
            cause = next(iter(e.failures.values()))
            raise PeerFailedError(
                f"rank(s) {', '.join(map(str, failed))} could not copy their shards from {source} "
                f"({type(first).__name__}: {first}), and reading them from storage ({plan.root}) failed too "
                f"({type(cause).__name__}: {first_line(cause)}): load "
                f"again from another live replica or holder, or from storage once the checkpoint is reachable") from e
        return dict(zip(ranks, stats))


def source_rank(mesh: Mesh, coord: Coord, replicas: int) -> int:
    """The rank of `mesh` that rank `coord` copies from: the same stage and tp rank, in replica
    `coord.replica % replicas` (receivers spread over the first `replicas` replicas that hold shards)."""
    return mesh.rank(dp=coord.replica % replicas, pp=coord.stage, tp=coord.tp_rank)
