"""A rank group: the rank actors (with the placement group(s) raylazy made for them, or the caller's own
actors), their lifecycle, and calls gathered by rank.

raylazy's own group is created before planning, so its actors start (import torch) while the
driver reads headers. Ranks are placed as one placement group, or one per pipeline stage (a
placement group has one strategy: each stage is packed on its own). Every failure of a call over
the group becomes one `RankFailedError` keyed by rank. `release()` removes the placement groups
and kills the actors raylazy started, on every path (a second interrupt during it included); the
caller's actors only drop their shards. A `Deadline` bounds the calls of one load: each waits what is left of it.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import ConfigurationError, PlacementError, RankFailedError
from .actor import RANK_METHODS, RankInfo, RankLoader
from .bundles import describe_resources
from .ray_internals import forget_rank, transports_registered_on_use


class Deadline:
    """`timeout_s` from now: the one bound on a load's steps after placement, each waiting what is left of it."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.end = timeout_s, time.monotonic() + timeout_s

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def missed(self, what: str) -> TimeoutError:
        return TimeoutError(f"{what} did not finish within {self.timeout_s:.0f} s (timeout_s)")


@dataclass
class RankGroup:
    """The actors of one load, the ranks in order over the bundles of `placement_groups` (one, or one per
    pipeline stage); `ranks` once they are ready.

    `owned`: raylazy created the actors (and the placement groups) and kills them on release; a group of the
    caller's actors (`adopt`) has no placement group and its release only drops their shards.
    """

    name: str
    actors: list
    placement_groups: list
    ranks: list[RankInfo] = field(default_factory=list)
    owned: bool = True
    #: The caller's actors' `rank_init` calls, sent by `adopt` and answered at the first `refresh`.
    starting: list = field(default_factory=list)

    @property
    def placement_group(self):
        """The placement group (with one per pipeline stage, the first stage's); None once released."""
        return self.placement_groups[0] if self.placement_groups else None

    @classmethod
    def create(cls, bundles: list[dict], device: str = "auto", strategy: str = "PACK", max_retries: int = 2,
               actor_cls: type = RankLoader, groups: int = 1) -> RankGroup:
        """Create the placement group(s) (one bundle per rank; `groups` > 1: that many groups of consecutive
        ranks, e.g. one per pipeline stage, each under `strategy`) and one `actor_cls` actor in each bundle.

        `actor_cls` is RankLoader or a subclass of it (to add methods of your own, or to observe
        the load: examples/autoscaling_experiment.py times each phase this way).
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not (isinstance(actor_cls, type) and issubclass(actor_cls, RankLoader)):
            raise ConfigurationError(f"actor_cls must be raylazy.cluster.actor.RankLoader or a subclass of it, got {actor_cls!r}")
        name = f"raylazy-{uuid.uuid4().hex[:8]}"
        size = len(bundles) // groups
        pgs = _placement_groups(name, bundles, strategy, groups)
        # Direct transports (cuda_ipc, gloo, nccl) in LoadedModel.refs() need tensor transport enabled on the class.
        remote_cls = ray.remote(enable_tensor_transport=True)(actor_cls)
        actors = []
        try:
            with transports_registered_on_use():  # no torch import on the driver between two ranks' creation
                for r, bundle in enumerate(bundles):
                    actors.append(remote_cls.options(
                        name=f"{name}-rank{r}",
                        num_cpus=bundle.get("CPU", 0),
                        num_gpus=bundle.get("GPU", 0),
                        max_concurrency=4,  # progress() and shards() answer while load() runs
                        max_restarts=max_retries,
                        max_task_retries=max_retries,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pgs[r // size],
                                                                             placement_group_bundle_index=r % size),
                    ).remote(r, device))
        except BaseException:  # e.g. a KeyboardInterrupt
            with _sigint_deferred():
                _remove(pgs)
                _kill_named(name, len(bundles))
            raise
        return cls(name, actors, pgs)

    @classmethod
    def adopt(cls, actors: list, device: str = "auto") -> RankGroup:
        """A group of the caller's actors, rank r being `actors[r]`: each must have `raylazy.RankMixin`'s methods;
        each is asked to become rank r (`rank_init`) now, and the group is ready at its first `refresh`."""
        missing = sorted({m for a in actors for m in RANK_METHODS if not hasattr(a, m)})
        if missing:
            raise ConfigurationError(f"actors= needs Ray actors whose class mixes in raylazy.RankMixin; some lack "
                                     f"{', '.join(missing)}")
        return cls(f"raylazy-{uuid.uuid4().hex[:8]}", list(actors), [], owned=False,
                   starting=[a.rank_init.remote(r, device) for r, a in enumerate(actors)])

    def refresh(self, deadline: Deadline, what: str = "info") -> list[RankInfo]:
        """Ask every actor where it runs now (a restarted rank has a new process, maybe on another node; the caller's
        actors answer their `rank_init` the first time)."""
        refs, self.starting = self.starting or [a.info.remote() for a in self.actors], []
        self.ranks = self.gather(refs, deadline, what) if self.actors else []
        return self.ranks

    @property
    def size(self) -> int:
        return len(self.actors)

    def wait_placed(self, placement_timeout_s: float) -> None:
        """Wait until the group's placement groups are placed (the caller's actors have none)."""
        import ray

        pgs = self.placement_groups
        ready = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=placement_timeout_s)[0] if pgs else []
        if len(ready) < len(pgs):
            bundle = self.placement_group.bundle_specs[0] if self.placement_group.bundle_specs else {}
            raise PlacementError(
                f"could not place {self.size} rank(s) ({describe_resources(bundle)} each) within "
                f"{placement_timeout_s:.0f} s; the cluster has {describe_resources(ray.cluster_resources())} in all "
                f"and {describe_resources(ray.available_resources())} free. Add nodes, lower tp, or pass "
                "use_gpu=False / a smaller cpus_per_rank"
            )

    def gather(self, refs: list, deadline: Deadline, what: str, grace_s: float = 2.0) -> list:
        """ray.get every rank's ref within `deadline`; failures (or the deadline passing) become one RankFailedError
        keyed by rank.

        After the first failure the others get `grace_s` more seconds (within the deadline) to report theirs,
        so one error lists every rank that failed at about the same time.
        """
        import ray

        until = deadline.end
        results, failures = {}, {}
        pending = dict(enumerate(refs))
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.0, until - time.monotonic()))
            for rank in [r for r, ref in pending.items() if ref in ready]:
                try:
                    results[rank] = ray.get(pending.pop(rank))
                except Exception as e:  # noqa: BLE001  (a rank's failure, reported with all others)
                    failures[rank] = cause(e)
                    until = min(until, time.monotonic() + grace_s)
            if pending and time.monotonic() >= until:
                if not failures:
                    failures = {r: TimeoutError(f"{deadline.missed(what)}{self._stuck(r)}") for r in pending}
                break
        if failures:
            raise RankFailedError(failures, what)
        return [results[r] for r in range(len(refs))]

    def _stuck(self, rank: int) -> str:
        """Why a rank that timed out may be stuck, when its actor is RESTARTING (e.g. its node was lost)."""
        try:
            from ray.util.state import list_actors

            states = {a.state for a in list_actors(filters=[("name", "=", f"{self.name}-rank{rank}")], timeout=10)}
        except Exception:  # noqa: BLE001  (best effort: the state API needs the dashboard; the timeout is the error)
            return ""
        if "RESTARTING" in states:
            return ("; its actor is RESTARTING: its process or node was lost and Ray found no room to "
                    "restart it (add capacity or lower tp)")
        return ""

    def release(self) -> None:
        """Remove the placement group, then kill the actors raylazy started (the caller's actors only drop their
        shards); idempotent, errors of what is already gone ignored. A Ctrl-C (SIGINT) arriving meanwhile is
        held until the release is done, then raised."""
        import ray

        with _sigint_deferred():
            _remove(self.placement_groups)  # first: removing them also ends the actors in them
            dropping = []
            for a in self.actors:
                try:
                    if self.owned:
                        ray.kill(a, no_restart=True)
                    else:
                        dropping.append(a.release.remote())
                except Exception:  # noqa: BLE001  (already dead)
                    pass
            for info in self.ranks if self.owned else ():  # the caller's actors forget theirs in release()
                try:
                    forget_rank(info.actor_id)
                except Exception:  # noqa: BLE001  (Ray is shutting down: its KV goes with it)
                    pass
            if dropping:  # the caller's actors may run calls concurrently: released means their shards are dropped
                ray.wait(dropping, num_returns=len(dropping), timeout=RELEASE_WAIT_S)
            self.actors, self.placement_groups, self.ranks = [], [], []


#: How long `release` waits for the caller's actors to drop their shards (a dead or stuck one is not waited for).
RELEASE_WAIT_S = 30.0

@contextmanager
def _sigint_deferred():
    """Hold SIGINT (Ctrl-C) while the block runs and raise KeyboardInterrupt after it if one came; outside the
    main thread (where signal handlers cannot be set) the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def _placement_groups(name: str, bundles: list[dict], strategy: str, groups: int) -> list:
    """`groups` placement groups of consecutive bundles under `strategy`, named from `name`; none is left behind
    when creating them is interrupted (a KeyboardInterrupt can land once a group exists but before it is
    returned: it is found by name and removed)."""
    import ray
    from ray.util.placement_group import placement_group

    size = len(bundles) // groups
    names = [name] if groups == 1 else [f"{name}-stage{g}" for g in range(groups)]
    pgs = []
    try:
        for g, pg_name in enumerate(names):
            pgs.append(placement_group(bundles[g * size : (g + 1) * size], strategy=strategy, name=pg_name))
    except BaseException:
        for pg_name in names[len(pgs):]:
            try:
                pgs.append(ray.util.get_placement_group(pg_name))
            except Exception:  # noqa: BLE001  (it was not created)
                pass
        _remove(pgs)
        raise
    return pgs


def _kill_named(name: str, size: int) -> None:
    """Kill group `name`'s rank actors, found by name: an actor whose creation was interrupted is registered but its
    handle may never have been returned, and one not yet scheduled in its placement group is not ended by the
    group's removal (a KeyboardInterrupt's traceback can keep its handle, and so the actor, alive)."""
    import ray

    for r in range(size):
        try:
            ray.kill(ray.get_actor(f"{name}-rank{r}"), no_restart=True)
        except Exception:  # noqa: BLE001  (never registered, or already dead)
            pass


def _remove(pgs: list) -> None:
    """Remove placement groups (those already removed are skipped)."""
    from ray.util.placement_group import remove_placement_group

    for pg in pgs:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001  (already removed)
            pass


def cause(e: Exception) -> BaseException:
    """The rank's own exception when Ray wrapped it (RayTaskError), else Ray's error."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, BaseException) else e
