"""Copying shards between ranks: a rank fills its shards from the rank with its coordinates in a live replica.

A receiving rank pulls its shards from its source rank (the same stage and tp rank, in a replica that
holds them) in batches of whole tensors of at most `staging_budget` bytes, requesting the next batch
before copying the current one into its own buffers. CPU shards travel through Ray's object store;
CUDA shards through Ray's direct tensor transport over NCCL (`peer_transport`), device to device,
never through host memory: the driver puts each source rank and its receivers in one collective
group for the copy and destroys it after. Nothing is read from storage. A failed copy (the source died,
holds no shards, or sent other tensors) is a `PeerFailedError` and the receiver keeps nothing; the
loader then reads those ranks from storage, or fails with one error when it cannot
(`raylazy.loader.load`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

from .errors import ConfigurationError, PeerFailedError, RankFailedError, first_line
from .io.common import Counter, ReadStats, shard_buffers
from .mesh import Coord, Mesh
from .options import LoadOptions
from .plans import Plan, RankPlan, TensorShard

log = logging.getLogger("raylazy")

#: The backend name a receiving rank's ReadStats carry.
BACKEND = "replica"


def source_rank(mesh: Mesh, coord: Coord, replicas: int) -> int:
    """The rank of `mesh` that rank `coord` copies from: the same stage and tp rank, in replica
    `coord.replica % replicas` (receivers spread over the first `replicas` replicas that hold shards)."""
    return mesh.rank(dp=coord.replica % replicas, pp=coord.stage, tp=coord.tp_rank)


def peer_transport(option: str, device: str) -> str:
    """The transport for copying shards on `device`: "auto" is the object store on the CPU, NCCL on a GPU;
    one that cannot carry the device is refused."""
    cuda = device.startswith("cuda")
    if option == "auto":
        return "nccl" if cuda else "object_store"
    if (option == "nccl" and not cuda) or (option == "gloo" and cuda):
        raise ConfigurationError(f"peer_transport={option!r} cannot carry shards on {device}: use 'auto', "
                                 f"'object_store' or {'nccl' if cuda else 'gloo'!r}")
    return option


def batches(plan: RankPlan, batch_bytes: int) -> Iterator[list[TensorShard]]:
    """The rank's shards in plan order, grouped into batches of at most `batch_bytes` (a larger shard alone)."""
    batch, size = [], 0
    for t in plan.tensors:
        if batch and size + t.nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += t.nbytes
    if batch:
        yield batch


def receive_shards(source, plan: RankPlan, device: str, batch_bytes: int, transport: str = "object_store",
                   on_progress: Callable[[int], None] | None = None, landed: dict | None = None,
                   out: dict | None = None) -> tuple[dict, ReadStats]:
    """In a receiving rank's actor: copy every shard of `plan` from the actor `source` (its `peer_shards`)
    into new tensors on `device`, or into `out` ({name: tensor}, the shards held: filled in place);
    returns ({name: tensor}, ReadStats). A failure is a PeerFailedError.

    A two-sided direct transport (NCCL, gloo) delivers tensors only as a task's argument: each batch is
    handed to this actor's own `land` (which puts it in `landed`, the actor's dict, under the batch's number)."""
    import ray
    import torch

    counter = Counter(on_progress)
    stats = ReadStats(backend=BACKEND, device=device, bytes_needed=plan.stats.bytes_needed)
    held = shard_buffers(torch, plan, torch.device(device), out)
    buffers = dict(zip((t.name for t in plan.tensors), (b for _, b in held)))
    start = time.perf_counter()
    todo = list(batches(plan, batch_bytes))
    group = None
    try:
        if transport == "object_store":
            call = source.peer_shards
        else:  # a collective group of the pair, known to this process: the one issuing the transfers
            from ray.experimental.collective import create_collective_group

            me = ray.get_runtime_context().current_actor
            group = create_collective_group([source, me], backend=transport)
            send = source.peer_shards.options(tensor_transport=transport)
            call = _Landing(send, me, landed)
        pending = call.remote([t.name for t in todo[0]]) if todo else None
        for i, batch in enumerate(todo):
            got = call.get(pending) if group is not None else ray.get(pending)
            pending = call.remote([t.name for t in todo[i + 1]]) if i + 1 < len(todo) else None
            for t in batch:
                _copy(buffers[t.name], got.get(t.name), t, plan.rank)
                counter.add(t.nbytes)
            del got
    except PeerFailedError:
        raise
    except Exception as e:  # noqa: BLE001  (the source died or failed: named here)
        raise PeerFailedError(
            f"rank {plan.rank}: copying its shards from a live replica failed after {counter.value} of "
            f"{sum(t.nbytes for t in plan.tensors)} bytes: {type(e).__name__}: "
            f"{first_line(e)}") from None
    finally:
        if group is not None:
            _destroy(group)
    stats.bytes_from_replica = counter.value
    stats.seconds = time.perf_counter() - start
    return buffers, stats


class _Landing:
    """Batches over a two-sided direct transport: the source's `peer_shards` ref passed to this actor's `land`."""

    def __init__(self, send, me, landed: dict):
        self.send, self.me, self.landed, self.n = send, me, landed, 0

    def remote(self, names: list[str]):
        self.n += 1
        return self.n, self.me.land.remote(self.n, self.send.remote(names))

    def get(self, pending) -> dict:
        import ray

        key, ref = pending
        ray.get(ref)
        return self.landed.pop(key)


def _copy(dst, src, t: TensorShard, rank: int) -> None:
    if src is None or src.dtype != dst.dtype or tuple(src.shape) != tuple(dst.shape):
        got = "nothing" if src is None else f"{src.dtype} {list(src.shape)}"
        raise PeerFailedError(f"rank {rank}: its source sent {got} for tensor {t.name!r}, planned as {dst.dtype} "
                              f"{list(dst.shape)}: the source holds another model or plan; load from storage")
    dst.copy_(src)


def _destroy(group) -> None:
    """Destroy a copy's collective group (best effort: a dead member's group is gone with it)."""
    from ray.experimental.collective import destroy_collective_group

    try:
        destroy_collective_group(group)
    except Exception:  # noqa: BLE001  (a member died)
        pass


def copy_from_replicas(group, plan: Plan, opts: LoadOptions, source, read: list[ReadStats],
                       in_place: bool = False) -> list[ReadStats]:
    """On the driver: the ranks of `group` after those that `read` from storage copy their shards from a live
    replica's rank with their coordinates (in `source`, a live LoadedModel, else in replica 0 of `group`); those
    whose copy fails read from storage instead (`_read_instead`). `in_place` (a reload): into the shards they
    hold. Returns every rank's ReadStats."""
    import ray

    from .group import cause

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
    in_place_kw = {"in_place": True} if in_place else {}  # only reloads pass it: an older `receive` override still loads
    refs = {r: group.actors[r].receive.remote(held.actors[s], plan.ranks[r], opts.reader, transport, **in_place_kw)
            for r, s in zip(ranks, feeds)}
    for r, ref in refs.items():
        try:
            stats[r] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001  (a failed copy: read from storage instead)
            failed[r] = cause(e)
    if failed:
        # in this load, a source that died lost its shards too (a restarted actor holds none): it reads again
        again = sorted(set(failed) | ({feeds[r - first] for r in failed} if source is None else set()))
        stats.update(_read_instead(group, plan, opts, again, failed, "reload" if in_place else "load"))
    return [stats[r] for r in range(plan.mesh.size)]


def _read_instead(group, plan: Plan, opts: LoadOptions, ranks: list[int], failed: dict, method: str) -> dict:
    """Ranks whose copy from a live replica failed read their shards from storage, each alone, with `method`
    ("load" or "reload"); when that fails too (the checkpoint is gone), one PeerFailedError naming both causes.
    Returns rank -> ReadStats."""
    first = next(iter(failed.values()))
    log.warning("raylazy: rank(s) %s could not copy their shards from a live replica (%s); reading rank(s) %s from "
                "storage (%s) instead", ",".join(map(str, failed)), first, ",".join(map(str, ranks)), plan.root)
    try:  # without a node task each rank reads alone (`read_rank`: node backends read ranged)
        stats = group.gather([getattr(group.actors[r], method).remote(plan.ranks[r], opts.reader) for r in ranks],
                             opts.timeout_s, f"{method} from storage")
    except RankFailedError as e:
        cause = next(iter(e.failures.values()))
        raise PeerFailedError(
            f"rank(s) {', '.join(map(str, failed))} could not copy their shards from a live replica "
            f"({type(first).__name__}: {first}), and reading them from storage ({plan.root}) failed too "
            f"({type(cause).__name__}: {first_line(cause)}): load "
            "again from another live replica, or from storage once the checkpoint is reachable") from e
    return dict(zip(ranks, stats))
