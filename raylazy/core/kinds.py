"""What kind of storage a checkpoint lives on, as the planner and the cost model see it: pure data, recognised by
the storage layer (`raylazy.storage.kinds`: the file system's type in the mount table or statfs) and kept in the
plan (`Plan.storage`), so a load can shape its reads for it and its summary can say which storage it read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StorageKind(BaseModel):
    """A storage as it reads: `name` is the kind ("local", "tmpfs", "overlay", "nfs", "lustre", "gpfs", "beegfs",
    "cephfs", "smb", "9p", "virtiofs", a FUSE file system by its name ("gcsfuse", "mountpoint-s3", "juicefs",
    "blobfuse2", ... or "fuse" for one unknown), or "object" for object storage); `fs_type` the file system type the
    mount table names ("ext4", "nfs4", "fuse.gcsfuse"; the URI scheme for object storage); `network` whether every
    read not served by a cache crosses a network; `page_cache` whether pages one process of the node read serve
    the node's other processes without reaching the storage (the kernel's page cache; GPFS's pagepool); and
    `mount_point` the mount holding the checkpoint ("" for object storage). `request_bytes` and `depth`: the size of
    the requests the kernel sends the storage and how many it keeps in flight, where the kernel says (0: it does
    not; `raylazy.storage.kinds.kernel_shape`); where it says no depth and every read reaches the storage, `depth`
    and `latency_s` (the seconds a request waits; 0: not measured) are what a probe of the mount timed
    (`raylazy.storage.probe`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    fs_type: str
    network: bool
    page_cache: bool
    mount_point: str = ""
    request_bytes: int = 0
    depth: int = 0
    latency_s: float = 0.0

    def describe(self) -> str:
        """One line for summaries: "nfs (nfs4 at /mnt/models), network, page cache shared, requests of 1024 KiB, 16
        in flight", the requests' shape where the kernel says it or a probe timed it."""
        where = f"{self.fs_type} at {self.mount_point}" if self.mount_point else self.fs_type
        shape = [text for text, known in ((f"requests of {self.request_bytes >> 10} KiB", self.request_bytes),
                                          (f"{self.latency_s * 1e3:.1f} ms a request (probed)", self.latency_s),
                                          (f"{self.depth} in flight", self.depth)) if known]
        return ", ".join([f"{self.name} ({where})", "network" if self.network else "local",
                          "page cache shared" if self.page_cache else "no shared page cache: every read reaches the "
                          "storage", *shape])
