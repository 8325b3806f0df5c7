"""Replicas on the driver: which live rank each receiving rank copies from, over which transport, and the fall
back to storage for the ranks whose copy fails (the copy itself runs in the rank: `raylazy.cluster.receive`)."""

from __future__ import annotations

import logging
import time

from ..core.mesh import Coord, Mesh
from ..core.options import LoadOptions
from ..core.plans import Plan
from ..errors import ConfigurationError, PeerFailedError, RankFailedError, first_line
from ..io.stats import ReadStats
from .group import cause

log = logging.getLogger("raylazy")

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


def copy_from_replicas(group, plan: Plan, opts: LoadOptions, source, read: list[ReadStats],
                       in_place: bool = False) -> list[ReadStats]:
    """On the driver: the ranks of `group` after those that `read` from storage copy their shards from a live
    replica's rank with their coordinates (in `source`, a live LoadedModel, else in replica 0 of `group`); those
    whose copy fails read from storage instead (`_read_instead`). `in_place` (a reload): into the shards they
    hold. Returns every rank's ReadStats."""
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
