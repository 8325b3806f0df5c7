"""The rank actor: a plain class that Ray wraps with `ray.remote` when the load creates it.

One instance per tensor-parallel rank. It imports torch when constructed (so the
driver can plan while actors start), reads its RankPlan onto its device with the
chosen backend, and keeps the shards resident for `shards()` and `run()`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

from .errors import NoShardsError
from .io.common import Counter, ReadStats
from .options import ReaderOptions
from .plans import RankPlan


@dataclass(frozen=True)
class RankInfo:
    """Where a rank runs: Ray node id, host, process, the GPUs Ray gave it, the device it loads to."""

    rank: int
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


class RankLoader:
    """Loads and holds one rank's shards."""

    def __init__(self, rank: int, device: str = "auto"):
        import ray
        import torch  # noqa: F401  (the slow import happens here, while the driver plans)

        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        self.info_ = RankInfo(
            rank=rank,
            node_id=ray.get_runtime_context().get_node_id(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            gpu_ids=gpu_ids,
            device=resolve_device(device, gpu_ids),
        )
        self._shards: dict | None = None
        self._progress = Counter()  # added to by the reader threads

    def info(self) -> RankInfo:
        return self.info_

    def progress(self) -> int:
        """Bytes of shard data loaded so far by the current load."""
        return self._progress.value

    def exchange_address(self) -> str:
        """`host:port` on this rank's node where its node's ranks can meet for an exchanged load
        (`raylazy.io.exchange`): the driver asks one rank per node and gives the answer to all of them."""
        import ray

        from .io.exchange import node_address

        return node_address(ray.util.get_node_ip_address())

    def load(self, plan: RankPlan, options: ReaderOptions, node=None) -> ReadStats:
        """Read this rank's shards onto its device; `node` (a `raylazy.schedule.NodeTask` or a
        `raylazy.io.coop_exchange.ExchangeTask`) is what a node backend needs to read with the other ranks
        of the node. On failure nothing is kept."""
        self._shards, self._progress = None, Counter()
        from .io.backends import backend_for, get_backend

        # the driver resolves "auto" per rank; a caller without a node task reads alone
        backend = (options.backend if node is not None
                   else backend_for(options.backend, 1, self.info_.device, plan.files))
        shards, stats = get_backend(backend).read(plan, self.info_.device, options=options,
                                                  on_progress=self._progress.add,
                                                  **({"node": node} if node is not None else {}))
        self._shards = shards
        return stats

    def receive(self, source, plan: RankPlan, batch_bytes: int, transport: str = "object_store") -> ReadStats:
        """Copy this rank's shards from `source`, the rank actor with the same stage and tp rank in a live replica
        (`raylazy.peers`), instead of reading storage. On failure (a PeerFailedError) nothing is kept."""
        self._shards, self._progress = None, Counter()
        from .peers import receive_shards

        self._landed: dict = {}
        shards, stats = receive_shards(source, plan, self.info_.device, batch_bytes, transport, self._progress.add,
                                       self._landed)
        self._shards = shards
        return stats

    def land(self, key: int, shards: dict) -> None:
        """A batch of shards arriving over a direct transport for `receive` (Ray delivers them as this argument)."""
        self._landed[key] = shards

    def peer_shards(self, names: list[str]) -> dict:
        """The shards named, for a rank copying them (`receive`): through the object store or a direct transport."""
        shards = self.shards()
        return {n: shards[n] for n in names if n in shards}

    def shards(self) -> dict:
        """This rank's {name: tensor}; returned through the object store or a direct tensor transport."""
        if self._shards is None:
            raise NoShardsError(
                f"rank {self.info_.rank} holds no shards (not loaded, failed, released, or its process was "
                "restarted after the load): load again"
            )
        return self._shards

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Call fn(rank, shards, *args, **kwargs) here, next to the shards, and return its result."""
        return fn(self.info_.rank, self.shards(), *args, **kwargs)

    def release(self) -> None:
        self._shards = None
        if self.info_.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
