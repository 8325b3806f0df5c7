"""`raylazy.load`: plan on the driver, one Ray actor per rank reads its ranges, refs come back.

The placement group and actors are created first so they start (import torch)
while the driver reads headers and plans. Whatever happens after they exist,
an error, a timeout or a KeyboardInterrupt, releases all of them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from .actor import RankInfo, RankLoader
from .errors import RankFailedError, RaylazyError
from .io.common import ReadStats
from .options import LoadOptions, load_options, reader_options
from .placement import cluster_has_gpus, rank_bundles, start_ranks, wait_placed
from .plans import Plan, format_bytes
from .planner import make_plan
from .rules import RulesLike

log = logging.getLogger("raylazy")


@dataclass
class LoadedModel:
    """A finished load: the plan, the rank actors holding their shards, statistics, and release()."""

    plan: Plan
    options: LoadOptions
    actors: list
    placement_group: Any
    ranks: list[RankInfo]
    stats: list[ReadStats]
    seconds: float
    _refs: dict = field(default_factory=dict, repr=False)

    @property
    def tp(self) -> int:
        return self.plan.tp

    def refs(self, transport: str | None = None) -> list:
        """Per rank, an ObjectRef resolving to {name: tensor}.

        transport: None uses the load's `transport` option ("auto": object store for
        CPU shards, CUDA IPC for GPU shards); "nccl"/"gloo" need a collective group
        (`ray.experimental.collective.create_collective_group`) with the consumers.
        """
        transport = transport or self.options.transport
        if transport not in self._refs:
            self._refs[transport] = [
                _shards_method(a, transport, info.device).remote() for a, info in zip(self.actors, self.ranks)
            ]
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
        reading = max((s.seconds for s in self.stats), default=0.0)
        return (
            f"raylazy: loaded {os.path.basename(self.plan.root) or self.plan.root} tp={self.tp} "
            f"backend={self.options.backend} on {len({i.node_id for i in self.ranks})} node(s): {format_bytes(needed)} "
            f"in {self.seconds:.2f} s end to end, {reading:.2f} s reading "
            f"({needed / max(reading, 1e-9) / 1e9:.2f} GB/s), read {format_bytes(read)} ({format_bytes(read - needed)} beyond the needed)"
        )

    def release(self) -> None:
        """Kill the rank actors and remove the placement group (idempotent)."""
        _release(self.actors, self.placement_group)
        self.actors, self.placement_group, self._refs = [], None, {}

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def load(
    model_dir: str | os.PathLike,
    tp: int = 8,
    *,
    rules: RulesLike | None = None,
    device: str = "auto",
    backend: str = "ranged",
    actor_cls: type = RankLoader,
    **options: Any,
) -> LoadedModel:
    """Load `model_dir` for tensor parallelism `tp`: each rank's actor reads only its byte ranges.

    Options (validated, see `raylazy.options.LoadOptions`): queue_size, threads,
    chunk_bytes, use_gpu, cpus_per_rank, placement_strategy, placement_timeout_s,
    timeout_s, max_retries, transport, progress, preset, uneven, max_gap, nogds.
    Starts a local Ray if none is initialised (or joins RAY_ADDRESS).
    """
    import ray

    opts = load_options(tp=tp, device=device, backend=backend, **options)
    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING)
    t0 = time.perf_counter()
    use_gpu = opts.use_gpu if opts.use_gpu is not None else (opts.device != "cpu" and cluster_has_gpus())
    pg, actors, name = start_ranks(actor_cls, opts.tp, opts.device, use_gpu, opts.cpus_per_rank,
                                   opts.placement_strategy, opts.max_retries)
    try:
        plan = make_plan(model_dir, opts.tp, rules=rules, preset=opts.preset, uneven=opts.uneven,
                         max_gap=opts.max_gap)
        wait_placed(pg, opts.tp, f"{rank_bundles(1, use_gpu, opts.cpus_per_rank)[0]} each, "
                    f"{opts.placement_strategy}", opts.placement_timeout_s)
        ranks = _gather(actors, [a.info.remote() for a in actors], opts.timeout_s, "start")
        reader = reader_options(opts)
        per_node = Counter(info.node_id for info in ranks)
        loads = [a.load.remote(rp, _rank_reader(reader, per_node[info.node_id]))
                 for a, rp, info in zip(actors, plan.ranks, ranks)]
        stats = _wait_with_progress(actors, loads, plan, opts)
    except BaseException:
        _release(actors, pg)
        raise
    loaded = LoadedModel(plan, opts, actors, pg, ranks, stats, time.perf_counter() - t0)
    _announce(loaded.summary())
    return loaded


def _rank_reader(reader, ranks_on_node: int):
    """fastsafetensors with nogds=None: a rank sharing its node with other ranks must not use GDS."""
    if reader.backend == "fastsafetensors" and reader.nogds is None and ranks_on_node > 1:
        return reader.model_copy(update={"nogds": True})
    return reader


def _shards_method(actor, transport: str, device: str):
    if transport == "auto":
        transport = "cuda_ipc" if device.startswith("cuda") else "object_store"
    return actor.shards if transport == "object_store" else actor.shards.options(tensor_transport=transport)


def _gather(actors, refs: list, timeout_s: float, what: str, grace_s: float = 2.0) -> list:
    """ray.get every rank's ref; failures (or a timeout) become one RankFailedError keyed by rank.

    After the first failure the others get `grace_s` more seconds to report theirs,
    so one error lists every rank that failed at about the same time.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    results, failures = {}, {}
    pending = dict(enumerate(refs))
    while pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for rank in [r for r, ref in pending.items() if ref in ready]:
            try:
                results[rank] = ray.get(pending.pop(rank))
            except Exception as e:  # noqa: BLE001  (a rank's failure, reported with all others)
                failures[rank] = _cause(e)
                deadline = min(deadline, time.monotonic() + grace_s)
        if pending and time.monotonic() >= deadline:
            if not failures:
                failures = {r: TimeoutError(f"{what} did not finish within {timeout_s:.0f} s{_stuck(actors[r])}")
                            for r in pending}
            break
    if failures:
        raise RankFailedError(failures, what)
    return [results[r] for r in range(len(refs))]


def _stuck(actor) -> str:
    """Why a rank that timed out may be stuck, when its actor is not alive (e.g. its node was lost)."""
    try:
        import ray._private.state as state

        info = state.actors(actor._actor_id.hex())
        if info.get("State") == "RESTARTING":
            return ("; its actor is RESTARTING: its process or node was lost and Ray found no room to "
                    "restart it (add capacity or lower tp)")
    except Exception:  # noqa: BLE001  (best effort: the timeout is the error)
        pass
    return ""


def _cause(e: Exception) -> BaseException:
    """The rank's own exception when Ray wrapped it (RayTaskError), else Ray's error."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e


def _wait_with_progress(actors, loads: list, plan: Plan, opts: LoadOptions) -> list[ReadStats]:
    import ray

    show = opts.progress if opts.progress is not None else sys.stderr.isatty()
    if not show:
        return _gather(actors, loads, opts.timeout_s, "load")
    from tqdm import tqdm

    total = sum(r.stats.bytes_needed for r in plan.ranks)
    start = time.monotonic()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"raylazy tp={plan.tp}", file=sys.stderr) as bar:
        while time.monotonic() - start < opts.timeout_s:
            ready, _ = ray.wait(loads, num_returns=len(loads), timeout=0.25)
            try:
                done = sum(ray.get([a.progress.remote() for a in actors], timeout=5))
            except Exception:  # noqa: BLE001  (a dead rank: _gather reports it below)
                break
            bar.update(done - bar.n)  # the ranks' own count, also after the last load: the bar is never forced full
            if len(ready) == len(loads):
                break
        stats = _gather(actors, loads, max(0.0, opts.timeout_s - (time.monotonic() - start)), "load")
    return stats


def _release(actors: list, pg) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001  (already dead)
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001  (already removed)
            pass


def _announce(line: str) -> None:
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.info(line)


__all__ = ["load", "LoadedModel", "RaylazyError"]
