"""What makes a Ray actor a rank: `RankMixin` (the methods raylazy calls) and `RankLoader`, raylazy's own rank actor.

Any actor class that mixes in `RankMixin` can be a rank (`raylazy.load(..., actors=[...])`):
raylazy calls `rank_init` once, then `load` (new shards) or `reload` (the same shard
tensors filled in place), and the caller works on the shards with `shards()` and `run()`.
`RankLoader` is the mixin plus a constructor, the class `raylazy.load` starts (Ray wraps it
with `ray.remote` at creation); it imports torch when constructed, so the driver plans while
actors start.

A rank's last completed read, its (RankPlan, ReaderOptions), is kept in Ray's internal KV
(`raylazy.cluster.ray_internals`) under the actor's id (which survives restarts), so an actor
that Ray restarts after its process died reads its plan again by itself (alone, with the ranged
backend for node backends: its node's peers are not reading with it).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.options import ReaderOptions
from ..core.plans import RankPlan
from ..core.schedule import NodeRead
from ..errors import NoShardsError
from ..io.stats import Counter, ReadStats
from .portable import Portable
from .ray_internals import forget_rank, remember_rank, remembered_rank

log = logging.getLogger("raylazy")


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs: its actor's id, Ray node id, host, process, the GPUs Ray gave it, the device it loads to."""

    rank: int
    actor_id: str
    node_id: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...]
    device: str


def resolve_device(requested: str, gpu_ids) -> str:
    """"auto": the GPU Ray assigned (visible as cuda:0) if CUDA works, else the CPU."""
    import torch

    if requested == "cpu" or (requested == "auto" and not (gpu_ids and torch.cuda.is_available())):
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError(f"device={requested!r} but CUDA is not available to this actor (Ray GPU ids {gpu_ids})")
    return "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES to the GPU(s) it assigned


def _own_actor_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None


@dataclass
class _RankState:
    """A rank's state inside its actor: the one attribute (`_raylazy`) the mixin adds to an instance."""

    info: RankInfo
    #: The shard tensors of the last load, kept (and refilled by reload) whether valid or not.
    shards: dict | None = None
    #: Whether `shards` hold a completed read (False from the moment a read may write into them).
    valid: bool = False
    progress: Counter = field(default_factory=Counter)  # added to by the reader threads
    #: Batches of shards that arrived over a direct transport for `receive`, by key.
    landed: dict = field(default_factory=dict)


_RECOVERING = threading.Lock()


class RankMixin:
    """The methods raylazy calls on a rank actor (`RANK_METHODS`); mix it into any Ray actor class to make it a rank.

    Setup and state: `rank_init(rank, device)` (called by `raylazy.load(..., actors=[...])`), `info()`,
    `progress()`. Reading: `load(plan, options, node_read=None)`, `reload(plan, options, node_read=None)`,
    `exchange_address()` (an exchanged load's meeting point), `forget_load(load_id)` (cleanup after a failed
    cooperative read), `take(root, identity, plan, options, timeout_s, in_place)` (out of a holder). Copies between
    replicas: `receive(source, plan, options, transport, in_place)` on the receiving rank, `peer_shards(names)` on
    its source, `land(key, shards)` for batches over a direct transport.
    The caller's: `shards()`, `run(fn, *args)`, `release()`. The instance gets one attribute, `_raylazy`. Create
    the actor with `max_concurrency` >= 2 (so `progress()` answers while `load()` runs) and
    `enable_tensor_transport=True` for direct transports in `LoadedModel.refs` and peer copies.
    """

    _raylazy: _RankState | None = None

    def rank_init(self, rank: int, device: str = "auto") -> RankInfo:
        """Become rank `rank`, loading to `device` ("auto": the GPU Ray gave this actor, else the CPU); holds nothing yet."""
        import ray

        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        self._raylazy = _RankState(RankInfo(
            rank=rank,
            actor_id=_own_actor_id() or "",
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=gpu_ids,
            device=resolve_device(device, gpu_ids),
        ))
        return self._raylazy.info

    def info(self) -> RankInfo:
        return self._rank().info

    def progress(self) -> int:
        """Bytes of shard data read so far by the current load or reload."""
        return self._rank().progress.value

    def exchange_address(self) -> str:
        """Serve the rendezvous of this rank's node for an exchanged load and return its `host:port`
        (`raylazy.io.collective.serve_rendezvous`): the driver asks each node's first rank and gives the answer
        to all of the node's ranks."""
        import ray

        from ..io.collective import serve_rendezvous

        return serve_rendezvous(ray.util.get_node_ip_address())

    def load(self, plan: RankPlan, options: ReaderOptions, node_read: NodeRead | None = None) -> ReadStats:
        """Read this rank's shards into new tensors on its device (the old ones are dropped first); `node_read`:
        its node's read, for a node backend reading with the other ranks of the node. On failure nothing is kept."""
        return self._read(plan, options, node_read, in_place=False)

    def reload(self, plan: RankPlan, options: ReaderOptions, node_read: NodeRead | None = None) -> ReadStats:
        """Read `plan` into the tensors this rank already holds (same objects, same memory); a rank holding
        none (a restarted process) allocates them. A plan whose shards do not fit them is a BufferMismatchError
        before anything is written. On a failure after that the rank holds nothing valid (NoShardsError)."""
        return self._read(plan, options, node_read, in_place=True)

    def receive(self, source, plan: RankPlan, options: ReaderOptions, transport: str = "object_store",
                in_place: bool = False) -> ReadStats:
        """Copy this rank's shards from `source`, the rank actor with the same stage and tp rank in a live replica
        (`raylazy.cluster.loading`, in batches of `options.staging_budget` bytes), instead of reading storage; `in_place`
        (a reload): into the shards it holds, as `reload` does. On failure (a PeerFailedError) nothing is kept
        (nothing valid, in place); restarted later, the rank reads `plan` from storage with `options`."""
        from .receive import receive_shards

        out = self._held_buffers(plan) if in_place else None
        state = self._begin(in_place)
        state.landed = {}
        shards, stats = receive_shards(source, plan, state.info.device, options.staging_budget, transport,
                                       state.progress.add, state.landed, out)
        self._hold(state, shards, plan, options)
        return stats

    def take(self, root: str, identity: str, plan: RankPlan, options: ReaderOptions, timeout_s: float,
             in_place: bool = False) -> ReadStats:
        """Copy this rank's shards out of the holder of checkpoint `root` on this node (else another node's: Ray's
        object transfer), which checks it still holds `identity` (`raylazy.cluster.holder.take`), instead of reading
        storage; `in_place` (a reload): into the shards it holds. On failure nothing is kept."""
        from ..io.backends import read_rank
        from .holder import take

        held, _ = take(root, identity, timeout_s)
        out = self._held_buffers(plan) if in_place else None
        state = self._begin(in_place)
        shards, stats = read_rank(plan, state.info.device, options=options.model_copy(update={"backend": "ranged"}),
                                  on_progress=state.progress.add, out=out,
                                  sources={f: held.source(f) for f in range(len(plan.files))})
        stats.backend, stats.bytes_from_holder, stats.bytes_read, stats.requests = "holder", stats.bytes_read, 0, 0
        self._hold(state, shards, plan, options)
        return stats

    def forget_load(self, load_id: str) -> None:
        """After a failed cooperative load `load_id`: remove what it left on this node (its ready map)."""
        from ..io.shared import remove_ready_maps

        remove_ready_maps(load_id)

    def land(self, key: int, shards: dict) -> None:
        """A batch of shards arriving over a direct transport for `receive` (Ray delivers them as this argument)."""
        self._rank().landed[key] = shards

    def peer_shards(self, names: list[str]) -> Portable:
        """The shards named, for a rank copying them (`receive`): through the object store or a direct transport
        (`Portable`: they unpickle as a plain {name: tensor}, float8 shards included)."""
        shards = self.shards()
        return Portable({n: shards[n] for n in names if n in shards})

    def shards(self) -> dict:
        """This rank's {name: tensor}; returned through the object store or a direct tensor transport."""
        state = self._rank()
        if not state.valid:
            raise NoShardsError(
                f"rank {state.info.rank} holds no shards (not loaded, a load or reload failed part-way, released, or "
                "its process was restarted and could not read its plan again): load or reload again"
            )
        return state.shards

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Call fn(rank, shards, *args, **kwargs) here, next to the shards, and return its result."""
        return fn(self._rank().info.rank, self.shards(), *args, **kwargs)

    def release(self) -> None:
        """Drop the shards (the actor lives on); a later restart of this actor does not read them again."""
        state, actor_id = self._raylazy, _own_actor_id()
        if actor_id:
            forget_rank(actor_id)
        if state is None:
            return
        state.shards, state.valid = None, False
        if state.info.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    # --- internals ----------------------------------------------------------------------------------

    def _rank(self) -> _RankState:
        """This rank's state; in an actor Ray restarted (its state gone), first read its last plan again."""
        if self._raylazy is None:
            with _RECOVERING:
                if self._raylazy is None and not self._recover():
                    raise NoShardsError("this actor is not a raylazy rank: raylazy.load(model, tp, actors=[...]) "
                                        "makes it one (rank_init)")
        return self._raylazy

    def _read(self, plan: RankPlan, options: ReaderOptions, node_read: NodeRead | None, in_place: bool) -> ReadStats:
        from ..io.backends import read_rank

        out = self._held_buffers(plan) if in_place else None
        state = self._begin(in_place)
        shards, stats = read_rank(plan, state.info.device, options=options, node_read=node_read,
                                  on_progress=state.progress.add, out=out)
        self._hold(state, shards, plan, options)
        return stats

    def _held_buffers(self, plan: RankPlan) -> dict | None:
        """The shards this rank holds, to be filled in place with `plan` (None: it holds none, e.g. a restarted
        process); a plan whose shards do not fit them is a BufferMismatchError, shards a read given up may still
        write into (a reload that stalled) a BuffersInUseError, and either leaves them as they were."""
        import torch

        from ..io.buffers import check_buffers
        from ..storage.watch import check_free

        state = self._rank()
        if state.shards is not None:
            check_buffers(plan, torch.device(state.info.device), state.shards)
            check_free(state.shards)
        return state.shards

    def _begin(self, in_place: bool) -> _RankState:
        """From here the shards may be written: nothing is valid (nor read again on a restart) until `_hold`."""
        state = self._rank()
        state.valid, state.progress = False, Counter()
        actor_id = _own_actor_id()
        if actor_id:
            forget_rank(actor_id)
        if not in_place:
            state.shards = None  # free the old shards before allocating new ones
        return state

    def _hold(self, state: _RankState, shards: dict, plan: RankPlan, options: ReaderOptions) -> None:
        """A completed read: keep the shards, and the plan in Ray's KV so that a restarted process reads it again."""
        state.shards, state.valid = shards, True
        actor_id = _own_actor_id()
        if actor_id:
            remember_rank(actor_id, pickle.dumps((state.info.rank, state.info.device, plan, options)))

    def _recover(self) -> bool:
        """If the KV holds this actor's last completed read (its process died and Ray restarted it), become
        that rank again and read the plan alone; returns whether it did. A failed read leaves no shards."""
        actor_id = _own_actor_id()
        entry = remembered_rank(actor_id) if actor_id else None
        if entry is None:
            return False
        rank, device, plan, options = pickle.loads(entry)
        self.rank_init(rank, device)
        try:
            self._read(plan, options, None, in_place=False)
        except Exception as e:  # noqa: BLE001  (the rank then holds no shards: shards() says so)
            log.warning("raylazy: rank %d restarted but could not read its plan again: %s", rank, e)
        return True


#: The methods raylazy calls on a rank actor: every public method of `RankMixin` (an actor given with `actors=`
#: must have them all).
RANK_METHODS = tuple(name for name, value in vars(RankMixin).items() if callable(value) and not name.startswith("_"))


class RankLoader(RankMixin):
    """raylazy's rank actor: `RankMixin` with a constructor that imports torch and becomes rank `rank` (or,
    restarted by Ray after a completed read, reads that plan again)."""

    def __init__(self, rank: int, device: str = "auto"):
        import torch  # noqa: F401  (the slow import happens here, while the driver plans)

        if not self._recover():
            self.rank_init(rank, device)
