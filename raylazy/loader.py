"""`raylazy.load`: plan on the driver, one Ray actor per rank reads its ranges, refs come back; `LoadedModel.reload`.

A thin composition: options -> Ray (joined or started) -> bundles checked against the
cluster -> a `RankGroup` created first, so its actors start (import torch) while the
driver plans (or the caller's own actors, `actors=`) -> each rank reads its plan
(`_read_ranks`) -> a `LoadedModel`. Whatever happens after the group exists, an error, a
timeout or a KeyboardInterrupt, releases all of it. `reload` plans another checkpoint of the
same layout and the same ranks read it, through the same step, into the shards they hold.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .actor import RankInfo, RankLoader
from .errors import ConfigurationError, LayoutMismatchError, NoShardsError, PeerFailedError, RankFailedError
from .group import RankGroup, _cause
from .io.backends import NODE_BACKENDS, backend_for, check_backend
from .io.common import ReadStats
from .options import LoadOptions, load_options
from .mesh import Coord, Mesh
from .peers import peer_transport, source_rank
from .placement import check_placeable, ensure_ray, rank_bundles, stage_strategy
from .plans import Plan, format_bytes
from .planner import make_plan, with_replicas
from .rules import RulesLike
from .schedule import NodeTask, group_by_node

log = logging.getLogger("raylazy")

#: How `LoadedModel.refs` may send shards, and the devices each transport carries.
TRANSPORT_DEVICES = {"object_store": ("cpu", "cuda"), "cuda_ipc": ("cuda",), "nccl": ("cuda",), "gloo": ("cpu",),
                     "nixl": ("cpu", "cuda")}


@dataclass
class LoadedModel:
    """A finished load: the plan, the rank group holding the shards, per-rank statistics, and release()."""

    plan: Plan
    options: LoadOptions
    group: RankGroup
    stats: list[ReadStats]
    seconds: float
    _refs: dict = field(default_factory=dict, repr=False)
    #: The rules the load planned with (reload plans with them too).
    rules: RulesLike | None = None

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def mesh(self) -> list[Coord]:
        """Each global rank's place in the mesh (replica, stage, tp rank), in the order of `refs()` and `ranks`."""
        return [self.plan.mesh.coord(r) for r in range(self.plan.mesh.size)]

    @property
    def actors(self) -> list:
        return self.group.actors

    @property
    def placement_group(self):
        return self.group.placement_group

    @property
    def ranks(self) -> list[RankInfo]:
        """Where each rank runs now, asked of the actors (a rank Ray restarted shows its new process)."""
        return self.group.refresh(self.options.timeout_s)

    @property
    def mesh(self) -> list[Coord]:
        """Per global rank, in `refs()` order: its replica, stage and tp rank."""
        return [self.plan.mesh.coord(r) for r in range(self.plan.mesh.size)]

    def refs(self, transport: str | None = None) -> list:
        """Per rank, an ObjectRef resolving to {name: tensor}.

        transport: None uses the load's `transport` option ("auto": the object store for CPU
        shards, CUDA IPC for GPU shards, which reaches only receivers on the same GPU); "nccl" and
        "gloo" need a collective group (`ray.experimental.collective.create_collective_group`)
        with the consumers. A transport that cannot carry the shards' device is refused.
        """
        transport = transport or self.options.transport
        if transport not in self._refs:
            self._refs[transport] = [_shards_method(a, _transport_for(transport, info.device)).remote()
                                     for a, info in zip(self.actors, self.ranks)]
        return self._refs[transport]

    def get(self, rank: int) -> dict:
        """Copy one rank's shards to the caller through the object store (for inspection and tests)."""
        import ray

        return ray.get(self.refs("object_store")[rank])

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list:
        """Call fn(rank, shards, *args, **kwargs) inside every rank actor; returns one ObjectRef per rank."""
        return [a.run.remote(fn, *args, **kwargs) for a in self.actors]

    def node_map(self) -> dict[int, tuple[str, str]]:
        """rank -> (Ray node id, device)."""
        return {i.rank: (i.node_id, i.device) for i in self.ranks}

    def summary(self) -> str:
        """One line: model, tp, bytes, end-to-end and reading seconds, GB/s, bytes read beyond the needed."""
        needed = sum(s.bytes_needed for s in self.stats)
        read = sum(s.bytes_read for s in self.stats)
        from_replica = sum(s.bytes_from_replica for s in self.stats)
        read_needed = sum(s.bytes_needed for s in self.stats if not s.bytes_from_replica)
        reading = max((s.seconds for s in self.stats), default=0.0)
        replicas = f" x {self.plan.mesh.dp} replicas" if self.plan.mesh.dp > 1 else ""
        return (
            f"raylazy: loaded {os.path.basename(self.plan.root) or self.plan.root} tp={self.tp}"
            f"{f' pp={self.plan.mesh.pp}' if self.plan.mesh.pp > 1 else ''}{replicas} "
            f"backend={','.join(sorted({s.backend for s in self.stats}))} on {len({i.node_id for i in self.ranks})} node(s): {format_bytes(needed)} "
            f"in {self.seconds:.2f} s end to end, {reading:.2f} s reading "
            f"({needed / max(reading, 1e-9) / 1e9:.2f} GB/s), read {format_bytes(read)} from storage "
            f"({format_bytes(read - read_needed)} beyond the needed), {format_bytes(from_replica)} copied from live replicas"
        )

    def reload(self, model_dir: str | os.PathLike, *, rules: RulesLike | None = None) -> "LoadedModel":
        """Read another checkpoint of the same layout into the shards the ranks hold: the same actors, the same
        tensors (no allocation, every `data_ptr` unchanged), so whatever holds them sees the new weights.

        Plans `model_dir` with the load's options and `rules` (default: the load's) from headers only; a
        layout that differs from the loaded one on any rank (tensor names, shapes, dtypes) is a
        LayoutMismatchError before any byte is written. A failure while the ranks read is one
        RankFailedError; ranks that failed hold nothing valid (NoShardsError) until a load or reload
        succeeds, and the others hold the new checkpoint. `plan`, `stats` and `seconds` describe the last
        successful reload. The ranks are not released on failure; do not reload while `run` calls use the
        shards. Returns self.
        """
        if not self.actors:
            raise NoShardsError("this LoadedModel was released: raylazy.load again")
        t0 = time.perf_counter()
        rules = self.rules if rules is None else rules
        plan = make_plan(model_dir, rules=rules, storage_options=self.options.reader.storage_options,
                         **dict(self.options.plan))
        check_backend(self.options.reader.backend, plan.ranks)
        check_same_layout(self.plan, plan)
        self._refs = {}
        self.group.refresh(self.options.timeout_s, "reload")  # a restarted rank may be on another node now
        self.plan, self.stats = _read_ranks(self.group, plan, self.options, "reload")
        self.rules, self.seconds = rules, time.perf_counter() - t0
        log.info("%s", self.summary())
        return self

    def release(self) -> None:
        """Kill the rank actors and remove the placement group (idempotent); actors given to `load(actors=)`
        are not killed: they drop their shards."""
        self.group.release()
        self._refs = {}

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def load(
    model_dir: str | os.PathLike | None = None,
    tp: int | None = None,
    *,
    pp: int | None = None,
    expert_parallel: bool = False,
    pp_layers: list[int] | None = None,
    replicas: int = 1,
    source: LoadedModel | None = None,
    mesh: Mesh | None = None,
    rules: RulesLike | None = None,
    device: str = "auto",
    backend: str = "auto",
    actor_cls: type = RankLoader,
    actors: list | None = None,
    **options: Any,
) -> LoadedModel:
    """Load `model_dir` (a directory, or a model id in the local Hugging Face cache) for tensor parallelism `tp`
    (default 1) and `pp` pipeline stages (default 1; or a `mesh`): each rank's actor reads only its byte ranges
    onto its device. Ranks are stage-major (`LoadedModel.mesh`); a stage holds its layers only (vLLM's split, or
    `pp_layers` per stage), and its tp ranks are packed on one node when a node can hold them. expert_parallel:
    routed MoE experts go whole to the tp ranks of their stage.

    rules: sharding rules before the preset (see `raylazy.rules`). device: "auto" (the GPU Ray gives the
    rank, else the CPU), "cpu" or "cuda". backend: "auto" (ranks sharing a node read cooperatively: through the
    page cache on CPUs, "cooperative"; stripes exchanged over NCCL on GPUs, "exchange"; a rank alone on its node
    reads "ranged"), or one of those, or "fastsafetensors". actor_cls: the rank actor's class, `RankLoader` or
    a subclass. actors: instead, the caller's Ray actors (one per rank, rank r = actors[r]) whose class mixes in
    `raylazy.RankMixin`: no placement group of raylazy's own (their placement is the caller's) and `release()`
    only drops their shards (the placement options are then unused).

    replicas: copies of the tp group (`mesh[g].replica`); replica 0's ranks read from storage, the others copy
    their shards from them (`raylazy.peers`). source: a live LoadedModel to copy every shard from (rank by rank,
    same stage and tp rank) with no storage access; model_dir, tp, mesh and rules then come from its plan. A
    rank whose copy fails reads from storage instead; when that fails too, a PeerFailedError.

    Options (validated before anything starts, see `raylazy.options`; a ConfigurationError otherwise): preset,
    uneven, max_gap (PlanOptions); queue_size, threads, chunk_bytes, stripe_bytes, stripe_timeout_s,
    staging_budget (also the batch of a peer copy), nogds (ReaderOptions); use_gpu, cpus_per_rank, placement_strategy,
    autoscale, placement_timeout_s, max_retries (PlacementOptions); timeout_s, transport, peer_transport, progress.
    Uses the Ray this process has initialised, else the cluster RAY_ADDRESS names, else starts a local one.
    """
    tp, pp, mesh = _replicated(model_dir, tp, pp, mesh, rules, replicas, source)
    opts = load_options(tp=tp, pp=pp, expert_parallel=expert_parallel, pp_layers=pp_layers, mesh=mesh,
                        device=device, backend=backend, **options)
    place, mesh = opts.placement, opts.plan.mesh
    own_ray = ensure_ray()
    t0 = time.perf_counter()
    if actors is not None:
        if actor_cls is not RankLoader:
            raise ConfigurationError("give actors= (your own rank actors) or actor_cls= (the class raylazy starts), "
                                     "not both")
        if len(actors) != mesh.size:
            raise ConfigurationError(f"actors= gives {len(actors)} actor(s) for {mesh.size} rank(s): "
                                     "give one per rank")
        group = RankGroup.adopt(actors, place.device, opts.timeout_s)
    else:
        bundles = rank_bundles(mesh.size, place, own_ray)
        groups = mesh.size // mesh.tp if mesh.pp > 1 else 1  # with stages, a placement group per stage (of each replica)
        strategy = stage_strategy(bundles, place, groups)
        check_placeable(bundles, strategy, place.autoscale, groups)
        group = RankGroup.create(bundles, place.device, strategy, place.max_retries, actor_cls, groups)
    try:
        plan = (with_replicas(source.plan, opts.plan.mesh.dp) if source is not None
                else make_plan(model_dir, rules=rules, storage_options=opts.reader.storage_options, **dict(opts.plan)))
        check_backend(opts.reader.backend, plan.ranks)
        group.wait_ready(place.placement_timeout_s, opts.timeout_s)
        read = []
        if source is None:  # replica 0 reads from storage; its node schedules (if any) are the load's
            scheduled, read = _read_ranks(group, plan.model_copy(update={"ranks": plan.ranks[: mesh.size // mesh.dp]}),
                                          opts, "load")
            plan = plan.model_copy(update={"nodes": scheduled.nodes})
        stats = _receive(group, plan, opts, source, read)
    except BaseException:
        group.release()
        raise
    loaded = LoadedModel(plan, opts, group, stats, time.perf_counter() - t0, rules=rules)
    log.info("%s", loaded.summary())
    return loaded


def _replicated(model_dir, tp, pp, mesh, rules, replicas: int, source: LoadedModel | None) -> tuple:
    """`load`'s (tp, pp, mesh) with its replicas: the mesh with dp=replicas (from the source's plan, given one)."""
    if source is not None:
        given = {k: v for k, v in (("model_dir", model_dir), ("tp", tp), ("pp", pp), ("mesh", mesh), ("rules", rules))
                 if v is not None}
        if model_dir is not None and os.path.abspath(model_dir) == os.path.abspath(source.plan.root):
            given.pop("model_dir")
        if tp == source.plan.tp:
            given.pop("tp")
        if pp == source.plan.mesh.pp:
            given.pop("pp")
        if given or not source.actors:
            raise ConfigurationError(
                f"load(source=...) copies the source's plan ({source.plan.root}, {source.plan.mesh}): "
                + (f"give no {', '.join(given)}" if given else "the source was released: load from storage"))
        base = source.plan.mesh
    elif model_dir is None:
        raise ConfigurationError("load() needs model_dir (a checkpoint directory or cached model id), or source= "
                                 "a live LoadedModel to copy")
    elif replicas == 1:
        return tp, pp, mesh
    elif mesh is not None and mesh.dp != 1:
        raise ConfigurationError(f"give replicas={replicas} or a mesh with dp={mesh.dp}, not both")
    else:
        base = mesh if mesh is not None else Mesh(tp=1 if tp is None else tp, pp=1 if pp is None else pp)
    return None, None, Mesh(**{**base.shape, "dp": replicas})


def _read_ranks(group: RankGroup, plan: Plan, opts: LoadOptions, method: str) -> tuple[Plan, list[ReadStats]]:
    """The ranks of `plan` (the group's first ranks) read their shards from storage: each rank's backend chosen,
    the node schedules and tasks made, then `method` ("load": new shards, "reload": into the shards held) called
    on each; returns the plan as read (with its node schedules, for node backends) and their ReadStats."""
    ranks = group.ranks[: len(plan.ranks)]
    nodes = group_by_node([r.node_id for r in ranks])
    readers = [_rank_reader(opts.reader, len(nodes.peers(r.rank)), r.device, plan.files) for r in ranks]
    if any(r.backend in NODE_BACKENDS for r in readers):
        plan = plan.for_nodes(nodes.node_of, opts.reader.stripe_bytes)
    tasks = _node_tasks(group, plan, readers, opts.timeout_s)
    calls = [getattr(a, method).remote(rp, reader, task)
             for a, rp, reader, task in zip(group.actors, plan.ranks, readers, tasks)]
    return plan, _wait_with_progress(group, calls, plan, opts)


def _receive(group: RankGroup, plan: Plan, opts: LoadOptions, source: LoadedModel | None,
             read: list[ReadStats]) -> list[ReadStats]:
    """The ranks after those that `read` from storage copy their shards from a live replica's rank with their
    coordinates (the source's, else replica 0 of this load); those whose copy fails read from storage instead
    (`_read_instead`). Returns every rank's ReadStats."""
    import ray

    first = len(read)
    ranks = range(first, plan.mesh.size)
    if not ranks:
        return read
    held = source.group if source is not None else group
    src_mesh, src_replicas = (source.plan.mesh, source.plan.mesh.dp) if source is not None else (plan.mesh, 1)
    feeds = [source_rank(src_mesh, plan.mesh.coord(r), src_replicas) for r in ranks]
    devices = {held.ranks[s].device for s in feeds} | {group.ranks[r].device for r in ranks}
    transport = peer_transport(opts.peer_transport, "cuda" if all(d.startswith("cuda") for d in devices) else "cpu")
    deadline = time.monotonic() + opts.timeout_s
    stats, failed = dict(enumerate(read)), {}
    refs = {r: group.actors[r].receive.remote(held.actors[s], plan.ranks[r], opts.reader, transport)
            for r, s in zip(ranks, feeds)}
    for r, ref in refs.items():
        try:
            stats[r] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001  (a failed copy: read from storage instead)
            failed[r] = _cause(e)
    if failed:
        # in this load, a source that died lost its shards too (a restarted actor holds none): it reads again
        again = sorted(set(failed) | ({feeds[r - first] for r in failed} if source is None else set()))
        stats.update(_read_instead(group, plan, opts, again, failed))
    return [stats[r] for r in range(plan.mesh.size)]


def _read_instead(group: RankGroup, plan: Plan, opts: LoadOptions, ranks: list[int], failed: dict) -> dict:
    """Ranks whose copy from a live replica failed read their shards from storage, each alone; when that fails
    too (the checkpoint is gone), one PeerFailedError naming both causes. Returns rank -> ReadStats."""
    first = next(iter(failed.values()))
    log.warning("raylazy: rank(s) %s could not copy their shards from a live replica (%s); reading rank(s) %s from "
                "storage (%s) instead", ",".join(map(str, failed)), first, ",".join(map(str, ranks)), plan.root)
    reader = opts.reader.model_copy(update={"backend": "ranged"}) if opts.reader.backend != "fastsafetensors" else opts.reader
    try:
        stats = group.gather([group.actors[r].load.remote(plan.ranks[r], reader) for r in ranks], opts.timeout_s,
                             "load from storage")
    except RankFailedError as e:
        cause = next(iter(e.failures.values()))
        raise PeerFailedError(
            f"rank(s) {', '.join(map(str, failed))} could not copy their shards from a live replica "
            f"({type(first).__name__}: {first}), and reading them from storage ({plan.root}) failed too "
            f"({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}): load "
            "again from another live replica, or from storage once the checkpoint is reachable") from e
    return dict(zip(ranks, stats))


def check_same_layout(loaded: Plan, new: Plan) -> None:
    """LayoutMismatchError unless every rank of `new` has the tensors of `loaded`'s rank, each with the same
    shard shape and dtype (what reading into the loaded shards needs); names the first difference."""
    if len(new.ranks) != len(loaded.ranks):
        raise LayoutMismatchError(f"{new.root}: planned for {len(new.ranks)} ranks, the loaded model has "
                                  f"{len(loaded.ranks)}: reload needs the same ranks; raylazy.load it instead")
    for old_rank, new_rank in zip(loaded.ranks, new.ranks):
        old = {t.name: f"{t.dtype} {list(t.shape)}" for t in old_rank.tensors}
        got = {t.name: f"{t.dtype} {list(t.shape)}" for t in new_rank.tensors}
        name = next((n for n in sorted(old.keys() | got.keys()) if old.get(n) != got.get(n)), None)
        if name is not None:
            raise LayoutMismatchError(
                f"{new.root}: rank {new_rank.rank}'s tensor {name!r} is {got.get(name, 'absent')} in the new "
                f"checkpoint but {old.get(name, 'absent')} in the loaded one (a reload needs the same tensor names, "
                "shapes and dtypes on every rank): raylazy.load it instead")


def _rank_reader(reader, ranks_on_node: int, device: str = "cpu", files: tuple = ()):
    """The rank's reader options: its backend chosen (`backend_for`); fastsafetensors with nogds=None: a rank
    sharing its node with other ranks must not use GDS."""
    reader = reader.model_copy(update={"backend": backend_for(reader.backend, ranks_on_node, device, files)})
    if reader.backend == "fastsafetensors" and reader.nogds is None and ranks_on_node > 1:
        return reader.model_copy(update={"nogds": True})
    return reader


def _node_tasks(group: RankGroup, plan: Plan, readers: list, timeout_s: float) -> list:
    """Per rank, what it needs to read with its node: a NodeTask (cooperative: one load id for the node's
    ready map), an ExchangeTask (exchange: the node's schedule, rank plans and meeting address, asked of the
    node's first rank), or None (a rank reading alone)."""
    from .io.coop_exchange import ExchangeTask

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


def _transport_for(transport: str, device: str) -> str:
    """The concrete transport for shards on `device` ("auto" chosen by device); one that cannot carry them is refused."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if transport == "auto":
        return "cuda_ipc" if kind == "cuda" else "object_store"
    if transport not in TRANSPORT_DEVICES:
        raise ConfigurationError(f"transport {transport!r} is not one of auto, {', '.join(TRANSPORT_DEVICES)}")
    if kind not in TRANSPORT_DEVICES[transport]:
        usable = [t for t, kinds in TRANSPORT_DEVICES.items() if kind in kinds]
        raise ConfigurationError(f"transport {transport!r} cannot carry shards on {device}: use one of {', '.join(usable)}")
    return transport


def _shards_method(actor, transport: str):
    return actor.shards if transport == "object_store" else actor.shards.options(tensor_transport=transport)


def _wait_with_progress(group: RankGroup, loads: list, plan: Plan, opts: LoadOptions) -> list[ReadStats]:
    import ray

    show = opts.progress if opts.progress is not None else sys.stderr.isatty()
    if not show:
        return group.gather(loads, opts.timeout_s, "load")
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
        stats = group.gather(loads, max(0.0, opts.timeout_s - (time.monotonic() - start)), "load")
    return stats


__all__ = ["load", "LoadedModel", "check_same_layout"]
