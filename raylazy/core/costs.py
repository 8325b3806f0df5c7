"""What reading costs on a storage, as an estimate of seconds for a number of requests and bytes: the planner asks
it whether a row-split tensor's rows are read sooner one request each (exactly the needed bytes) or as one range
with the gaps between the rows (`Read.gather`: fewer requests, more bytes), and the readers take from it how many
requests to keep in flight and how large (`raylazy.core.options.ReaderOptions.shaped`). Pure data, made by the
storage (`raylazy.storage.Storage.cost_model`): object storage's measured on its first GETs, a network file
system's from its kind and what the kernel or a probe says of its mount (`for_kind`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .kinds import StorageKind
from .plans import RankPlan, Read


@dataclass(frozen=True)
class CostModel:
    """A store reached by `concurrency` connections at once: each request waits `request_s` for its first byte,
    then streams at `connection_bps`; a range larger than `part_bytes` is fetched as parts, one request each; all
    connections together move at most `bandwidth_bps` (0: `concurrency` x `connection_bps`), and the store serves
    at most `request_rate` requests a second (0: no limit; S3 documents 5,500 GETs a second per prefix)."""

    request_s: float
    connection_bps: float
    concurrency: int = 1
    part_bytes: int = 8 << 20
    bandwidth_bps: float = 0.0
    request_rate: float = 0.0

    def seconds(self, requests: int, nbytes: int) -> float:
        """Estimated seconds for `requests` requests moving `nbytes` bytes in all: the connections' busy time
        (each request's wait plus its bytes at connection speed) shared by `concurrency` connections, the bytes
        at `bandwidth_bps` or the requests at `request_rate`, whichever is longest."""
        busy = (requests * self.request_s + nbytes / self.connection_bps) / self.concurrency
        return max(busy, nbytes / self.bandwidth_bps if self.bandwidth_bps else 0.0,
                   requests / self.request_rate if self.request_rate else 0.0)

    def ranges(self, nbytes: int) -> int:
        """Requests for one range of `nbytes` (its parts)."""
        return max(1, -(-nbytes // self.part_bytes))

    def gather(self, length: int, stride: int, count: int) -> bool:
        """Whether `count` rows of `length` bytes, `stride` bytes apart, are estimated to arrive sooner as one range
        (gaps included) than as one request per row."""
        span = (count - 1) * stride + length
        return self.seconds(self.ranges(span), span) <= self.seconds(count * self.ranges(length), count * length)

    def read_cost(self, read: Read) -> tuple[int, int]:
        """(requests, bytes) of one planned read."""
        if read.gather or read.count == 1:
            return self.ranges(read.span), read.span
        return read.count * self.ranges(read.length), read.bytes_needed

    def rank_seconds(self, plan: RankPlan) -> float:
        """Estimated seconds for a rank reading its plan alone (header checks not counted)."""
        costs = [self.read_cost(r) for t in plan.tensors for r in t.reads]
        return self.seconds(sum(c[0] for c in costs), sum(c[1] for c in costs))


#: Network file systems by kind (`StorageKind.name`), per client node, as their documentation puts them: a
#: request's wait, one connection's rate, the requests worth keeping in flight, and the request size the storage
#: serves well (docs/network-storage.md has the sources).
_NETWORK: dict[str, CostModel] = {
    # NFSv4.1 (EFS, Filestore, NetApp): about 1 ms a request, rsize 1 MiB; one mount takes nconnect up to 16.
    "nfs": CostModel(request_s=0.001, connection_bps=300e6, concurrency=16, part_bytes=1 << 20),
    # Lustre: sub-millisecond RPCs of 4 MiB (brw_size), GB/s a client across its object storage targets.
    "lustre": CostModel(request_s=0.0005, connection_bps=1e9, concurrency=16, part_bytes=4 << 20),
    # GPFS: blocks of 4-16 MiB, prefetched by its own threads into the pagepool.
    "gpfs": CostModel(request_s=0.0005, connection_bps=1e9, concurrency=16, part_bytes=4 << 20),
    # CephFS: files striped over 4 MiB objects.
    "cephfs": CostModel(request_s=0.001, connection_bps=500e6, concurrency=16, part_bytes=4 << 20),
    # BeeGFS: files striped in chunks of 512 KiB by default.
    "beegfs": CostModel(request_s=0.0005, connection_bps=1e9, concurrency=16, part_bytes=512 << 10),
    # A bucket mounted through FUSE: a GET per request, tens of ms to its first byte, ~100 MB/s a stream.
    **{name: CostModel(request_s=0.03, connection_bps=100e6, concurrency=32, part_bytes=8 << 20)
       for name in ("gcsfuse", "mountpoint-s3", "blobfuse2", "s3fs", "goofys", "rclone", "juicefs")},
}
#: Any other network storage (an unknown file system or FUSE mount, SMB, 9p, virtiofs, sshfs): a few ms a
#: request, 4 MiB requests, 16 in flight.
_OTHER_NETWORK = CostModel(request_s=0.002, connection_bps=200e6, concurrency=16, part_bytes=4 << 20)


def for_kind(kind: StorageKind | None) -> CostModel | None:
    """What reads cost on a file system of `kind`: None where a request costs little (local disks, tmpfs), the
    kind's figures for network storage, with the request size and depth the kernel says its mount is read with
    (`StorageKind.request_bytes`, `depth`), or the wait and depth a probe of the mount timed (`latency_s`,
    `depth`), in place of the kind's where they are known."""
    if kind is None or not kind.network:
        return None
    costs = _NETWORK.get(kind.name, _OTHER_NETWORK)
    return replace(costs, request_s=kind.latency_s or costs.request_s,
                   part_bytes=kind.request_bytes or costs.part_bytes, concurrency=kind.depth or costs.concurrency)
