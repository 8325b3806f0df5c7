"""`raylazy.load`: plan on the driver, one Ray actor per rank reads its ranges, refs come back; `LoadedModel.reload`.

A thin composition: options -> Ray (joined or started) -> a `raylazy.cluster.loading.Load`, which starts the
rank group (its actors start, importing torch, while the driver plans; or the caller's own actors, `actors=`) and
runs the load's steps (whatever happens once the group exists, an error, a timeout or a KeyboardInterrupt,
releases all of it) -> a `LoadedModel`. `reload` runs a `Load` of another checkpoint of the same layout by the
same ranks, into the shards they hold.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.choices import choose_transport
from ..core.mesh import Coord, Mesh
from ..core.options import LoadOptions, load_options
from ..core.plans import Plan, format_bytes
from ..core.rules import RulesLike
from ..errors import ConfigurationError, NoShardsError
from ..io.stats import ReadStats
from .actor import RankInfo, RankLoader
from .bundles import ensure_ray
from .group import Deadline, RankGroup
from .holder import HeldModel
from .loading import Load
from .portable import portable_shards

log = logging.getLogger("raylazy")


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
    #: Seconds of the load's steps: start (placement asked, actors created), plan, ready (waiting for the ranks
    #: after planning: they start while the driver plans), read, copy (replicas).
    phases: dict[str, float] = field(default_factory=dict)

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
        return self.group.refresh(Deadline(self.options.timeout_s))

    def refs(self, transport: str | None = None) -> list:
        """Per rank, an ObjectRef resolving to {name: tensor}.

        transport: None uses the load's `transport` option ("auto": the object store for CPU
        shards, CUDA IPC for GPU shards, which reaches only receivers on the same GPU); "nccl" and
        "gloo" need a collective group (`ray.experimental.collective.create_collective_group`)
        with the consumers. A transport that cannot carry the shards' device is refused.
        """
        transport = transport or self.options.transport
        if transport not in self._refs:
            self._refs[transport] = [_shards_ref(a, choose_transport(transport, info.device, {"cpu": "object_store", "cuda": "cuda_ipc"}))
                                     for a, info in zip(self.actors, self.group.ranks)]
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
        """One line: model, mesh, bytes, end-to-end and reading seconds, GB/s, bytes read from storage as planned for
        the shards that read them (less than their sum when a node's ranks read shared bytes once), bytes copied from
        replicas and holders, and the bytes the ranks' read calls returned, measured (`ReadStats.rchar`); with the backend, the
        storage kind and the read shape (most requests in flight, their largest size), and the end-to-end time's
        split into the load's `phases`."""
        needed = sum(s.bytes_needed for s in self.stats)
        read = sum(s.bytes_read for s in self.stats)
        rchar = [s.rchar for s in self.stats]
        from_replica = sum(s.bytes_from_replica for s in self.stats)
        from_holder = sum(s.bytes_from_holder for s in self.stats)
        read_needed = sum(s.bytes_needed for s in self.stats if not (s.bytes_from_replica or s.bytes_from_holder))
        reading = max((s.seconds for s in self.stats), default=0.0)
        replicas = f" x {self.plan.mesh.dp} replicas" if self.plan.mesh.dp > 1 else ""
        shape = max(((s.in_flight, s.request_bytes) for s in self.stats), default=(0, 0))
        storage = ",".join(sorted({s.storage for s in self.stats if s.storage})) or "storage"
        shaped = f" ({storage}: {shape[0]} requests of up to {format_bytes(shape[1])} in flight)" if shape[0] else ""
        return (
            f"raylazy: loaded {os.path.basename(self.plan.root) or self.plan.root} tp={self.tp}"
            f"{f' pp={self.plan.mesh.pp}' if self.plan.mesh.pp > 1 else ''}{replicas} "
            f"backend={','.join(sorted({s.backend for s in self.stats}))}{shaped} on {len({i.node_id for i in self.group.ranks})} node(s): {format_bytes(needed)} "
            f"in {self.seconds:.2f} s end to end{self._split()}, {reading:.2f} s reading "
            f"({needed / max(reading, 1e-9) / 1e9:.2f} GB/s), planned {format_bytes(read)} from storage "
            f"for {format_bytes(read_needed)} of their shards, {format_bytes(from_replica)} copied from live replicas, "
            f"{format_bytes(from_holder)} from holders, "
            f"read calls returned {'?' if None in rchar else format_bytes(sum(rchar))} (rchar)"
        )

    def _split(self) -> str:
        return f" ({', '.join(f'{k} {v:.2f}' for k, v in self.phases.items() if v >= 0.005)} s)" if self.phases else ""

    def reload(self, model_dir: str | os.PathLike, *, rules: RulesLike | None = None) -> LoadedModel:
        """Read another checkpoint of the same layout into the shards the ranks hold: the same actors, the same
        tensors (no allocation, every `data_ptr` unchanged), so whatever holds them sees the new weights.

        Plans `model_dir` with the load's options and `rules` (default: the load's) from headers only; a
        layout that differs from the loaded one on any rank (tensor names, shapes, dtypes) is a
        LayoutMismatchError before any byte is written. A failure while the ranks read is one
        RankFailedError; ranks that failed hold nothing valid (NoShardsError) until a load or reload
        succeeds, and the others hold the new checkpoint. `plan`, `stats` and `seconds` describe the last
        successful reload. With replicas, replica 0's ranks read from storage and the others copy from them, in
        place (as `load` does). The ranks are not released on failure; do not reload while `run` calls use the
        shards. Returns self.
        """
        if not self.actors:
            raise NoShardsError("this LoadedModel was released: raylazy.load again")
        t0 = time.perf_counter()
        rules = self.rules if rules is None else rules
        self._refs = {}
        job = Load(self.group, self.options, held=self.plan)
        self.plan, self.stats = job.run(model_dir, rules)
        self.rules, self.seconds, self.phases = rules, time.perf_counter() - t0, job.phases
        log.info("%s", self.summary())
        return self

    def release(self) -> None:
        """Kill the rank actors and remove the placement group (idempotent); actors given to `load(actors=)`
        are not killed: they drop their shards."""
        self.group.release()
        self._refs = {}

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def load(
    model_dir: str | os.PathLike | None = None, tp: int | None = None, *, pp: int | None = None,
    expert_parallel: bool = False, pp_layers: list[int] | None = None, replicas: int = 1,
    source: LoadedModel | HeldModel | None = None, mesh: Mesh | None = None, rules: RulesLike | None = None,
    device: str = "auto", backend: str = "auto", actor_cls: type = RankLoader, actors: list | None = None,
    **options: Any,
) -> LoadedModel:
    """Load `model_dir` (a directory, URI, or model id in the local Hugging Face cache) over `tp` x `pp` ranks (or a
    `mesh`), one Ray actor per rank reading only its byte ranges onto its device (docs/loading.md).

    Ranks are stage-major (`LoadedModel.mesh`); a stage holds its layers only (vLLM's split, or `pp_layers`), its
    tp ranks packed on one node when a node holds them; `expert_parallel`: routed experts whole to the tp ranks of
    their stage. `rules` go before the preset. `device`: "auto" (the rank's GPU, else the CPU), "cpu", "cuda".
    `backend`: "auto" (cooperative on CPUs, exchange on GPUs for ranks sharing a node; ranged alone), "ranged",
    "cooperative", "exchange" or "fastsafetensors". `actor_cls`: `RankLoader` or a subclass; or `actors`: the
    caller's actors (one per rank, a `raylazy.RankMixin` each), placed by the caller and only emptied on release.
    `replicas`: copies of the grid; replica 0 reads storage, the others copy from it. `source`: a live
    LoadedModel every rank copies from, reading no storage; or a `raylazy.hold` of the checkpoint (a HeldModel),
    every rank (of every replica) copying out of the holder on its node, storage read only for the headers. Options (`raylazy.core.options`, checked before
    anything starts: a ConfigurationError names a bad one) are PlanOptions', ReaderOptions', PlacementOptions'
    and LoadOptions' fields. Uses the Ray this process initialised, else RAY_ADDRESS's, else starts a local one.
    """
    if isinstance(source, HeldModel):  # read as from storage, every rank out of the holder on its node
        if model_dir is not None and os.path.abspath(model_dir) != os.path.abspath(source.root):
            raise ConfigurationError(f"load(source=...) takes {source.root} from its holders: give no other "
                                     f"model_dir ({model_dir})")
        model_dir = source.root
    tp, pp, mesh = _replicated(model_dir, tp, pp, mesh, rules, replicas,
                               source if isinstance(source, LoadedModel) else None)
    opts = load_options(tp=tp, pp=pp, expert_parallel=expert_parallel, pp_layers=pp_layers, mesh=mesh,
                        device=device, backend=backend, **options)
    own_ray = ensure_ray()
    t0 = time.perf_counter()
    job = Load.start(opts, own_ray, actor_cls, actors)
    started = time.perf_counter() - t0
    plan, stats = job.run(model_dir, rules, source)
    loaded = LoadedModel(plan, opts, job.group, stats, time.perf_counter() - t0, rules=rules,
                         phases={"start": started, **job.phases})
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


def _shards_ref(actor, transport: str):
    """The ref of `actor`'s shards over `transport` (through the object store as `Portable`: float8 shards too)."""
    if transport == "object_store":
        return actor.run.remote(portable_shards)
    return actor.shards.options(tensor_transport=transport).remote()


__all__ = ["load", "LoadedModel"]
