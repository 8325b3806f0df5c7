"""The node-read driver: from the nodes the ranks run on, it says what each rank reads with and gives the ranks
that read with their node that node's `NodeRead`, for any transport: `raylazy.load` (`raylazy.cluster.loading`:
Ray's actors) and the vLLM format (each batch of regions: the workers of a torch process group, `ProcessGroupNode`)
pass in where the ranks run and how to ask a node's first rank where the node meets."""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..core.choices import choose_backend, maps_safely
from ..core.kinds import StorageKind
from ..core.options import ReaderOptions
from ..core.plans import FileRef, Plan
from ..core.schedule import NodeRead, group_by_node, node_schedule
from ..storage import local_path


def shares_page_cache(files: tuple[FileRef, ...], storage: StorageKind | None = None) -> bool:
    """Whether the files are local ones on `storage` whose page cache a mapping of them shares (not object
    storage, not a FUSE mount serving direct_io)."""
    return all(local_path(f.uri) is not None for f in files) and (storage is None or storage.page_cache)


@dataclass(frozen=True)
class RankRead:
    """How one rank reads: its reader options (the backend chosen, nogds set) and its node's read, if it reads
    with its node."""

    reader: ReaderOptions
    node_read: NodeRead | None = None


def node_reads(plan: Plan, node_ids: Sequence[str], devices: Sequence[str], reader: ReaderOptions, load_id: str,
               meet: Callable[[list[int]], list[str]]) -> tuple[Plan, list[RankRead]]:
    """Each of the first len(node_ids) ranks of `plan` reading it (rank r on node `node_ids[r]`, loading to
    `devices[r]`): the plan with its nodes' schedules where any reads with its node, and each rank's `RankRead`.
    `meet(ranks)` gives the meeting address of the exchanging nodes whose first ranks are `ranks` (asked once, all
    of them together); `load_id` names the reads (a node's ready map)."""
    nodes, shared, mappable = group_by_node(node_ids), shares_page_cache(plan.files, plan.storage), \
        maps_safely(plan.storage)
    choices = [choose_backend(reader.backend, len(nodes.peers(r)), d, shared, reader.nogds, mappable=mappable)
               for r, d in enumerate(devices)]
    readers = [reader.model_copy(update={"backend": c.backend, "nogds": c.nogds}) for c in choices]
    if not any(c.with_node for c in choices):
        return plan, [RankRead(r) for r in readers]
    backend = {node_ids[r]: c.backend for r, c in enumerate(choices) if c.with_node}
    # staged (no page cache to share), the bytes one rank alone keeps go straight into its shards
    plan = plan.model_copy(update={"nodes": tuple(
        node_schedule(plan, peers, node, reader.stripe_bytes, direct=backend.get(node) == "cooperative" and not shared)
        for node, peers in nodes.nodes.items())})
    meeting = [n for n in plan.nodes if backend.get(n.node) == "exchange"]
    address = dict(zip((n.node for n in meeting), meet([n.ranks[0] for n in meeting]) if meeting else ()))
    reads = {n.node: node_read(backend[n.node], plan, n, load_id, address.get(n.node, ""))
             for n in plan.nodes if n.node in backend}
    return plan, [RankRead(rd, reads[plan.node_of(r).node] if c.with_node else None)
                  for r, (rd, c) in enumerate(zip(readers, choices))]


def node_read(backend: str, plan: Plan, schedule, load_id: str, address: str = "") -> NodeRead:
    """What every rank of node `schedule` gets to read `plan` with node backend `backend`: the exchange's readers
    send each rank what it keeps, so they get the plans of all the node's ranks (and `address`, where they meet);
    cooperative ranks meet in the page cache and need only the schedule, `load_id` and whether the files may be
    mapped (`maps_safely`, from the storage the plan names: the ranks read nothing but the checkpoint), or, on
    storage with no page cache to share, in stages in shared memory (`staged`)."""
    plans = tuple(plan.ranks[r] for r in schedule.ranks) if backend == "exchange" else ()
    staged = backend == "cooperative" and not shares_page_cache(plan.files, plan.storage)
    return NodeRead(schedule, plans, load_id, address, maps_safely(plan.storage), staged)


class NodeGroup(Protocol):
    """The processes loading one checkpoint at once (vLLM's workers), this one being number `rank` of `size`."""

    rank: int
    size: int

    def gather(self, obj) -> Callable[[], list]:
        """Start this process's part in gathering every process's `obj` (a collective: all of them call it, in the
        same order); the call returned waits for the others and gives their objects, in rank order."""


class ProcessGroupNode:
    """The processes of a torch.distributed CPU (gloo) process group as a `NodeGroup` (vLLM's workers: its world's
    CPU group). A gathering is one all_gather, started without waiting, of a 256-byte slot per process: the size
    of its object pickled, then the pickle where it fits (a process copying at once sends None), and, only where
    one does not fit, a second all_gather of every pickle."""

    #: Pickled bytes a slot carries (the size before them: 8 bytes).
    INLINE = 248

    def __init__(self, rank: int, size: int, group):
        self.rank, self.size, self._group = rank, size, group

    def gather(self, obj) -> Callable[[], list]:
        import torch

        data = pickle.dumps(obj)
        slot = _bytes(len(data).to_bytes(8, "little") + (data if len(data) <= self.INLINE else b""), 8 + self.INLINE)
        slots = [torch.empty_like(slot) for _ in range(self.size)]
        started = torch.distributed.all_gather(slots, slot, group=self._group, async_op=True)

        def wait() -> list:
            started.wait()
            sizes = [int.from_bytes(s[:8].numpy().tobytes(), "little") for s in slots]
            largest = max(sizes)
            if largest <= self.INLINE:
                return [pickle.loads(s[8 : 8 + n].numpy().tobytes()) for s, n in zip(slots, sizes)]
            whole = [torch.empty(largest, dtype=torch.uint8) for _ in range(self.size)]
            torch.distributed.all_gather(whole, _bytes(data, largest), group=self._group)
            return [pickle.loads(w[:n].numpy().tobytes()) for w, n in zip(whole, sizes)]

        return wait


def _bytes(data: bytes, n: int):
    """`data` at the start of a zeroed uint8 tensor of `n` bytes."""
    import torch

    out = torch.zeros(n, dtype=torch.uint8)
    out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def node_key() -> str:
    """What identifies this machine (its page cache): the host name and the kernel's boot id."""
    boot = "/proc/sys/kernel/random/boot_id"
    return f"{socket.gethostname()}/{Path(boot).read_text().strip() if os.path.exists(boot) else ''}"
