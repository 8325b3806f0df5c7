"""A rank copies its shards from the rank with its coordinates in a live replica (run inside the receiving
rank's actor; the driver's side is `raylazy.cluster.loading`).

The receiving rank pulls its shards from its source rank in batches of whole tensors of at most
`staging_budget` bytes, requesting the next batch before copying the current one into its own buffers. CPU
shards travel through Ray's object store; CUDA shards through Ray's direct tensor transport over NCCL, device to
device: this rank makes a collective group with its source for the copy and destroys it after. Nothing is read
from storage. A failed copy (the source died, holds no shards, or sent other tensors) is a `PeerFailedError` and
the receiver keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..core.plans import RankPlan, TensorShard
from ..errors import PeerFailedError, first_line
from ..io.buffers import shard_buffers
from ..io.stats import Counter, Meter, ReadStats

#: The backend name a receiving rank's ReadStats carry.
BACKEND = "replica"


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

    counter, meter = Counter(on_progress), Meter()
    stats = ReadStats(backend=BACKEND, device=device, bytes_needed=plan.stats.bytes_needed)
    held = shard_buffers(torch, plan, torch.device(device), out)
    buffers = dict(zip((t.name for t in plan.tensors), (b for _, b in held)))
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
                _copy_shard(buffers[t.name], got.get(t.name), t, plan.rank)
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
    return buffers, meter.stop(stats)


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


def _copy_shard(dst, src, t: TensorShard, rank: int) -> None:
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
