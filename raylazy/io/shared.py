"""The files a node's ranks share while they read it together (`raylazy.io.cooperative`), in /dev/shm: the ready map
of the stripes' states and, on storage with no page cache to share, the stages the node's bytes are fetched into."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import tempfile

from ..core.plans import NodeSchedule, RankPlan
from ..errors import ConfigurationError, ReadError
from .mapping import prefault, punch_hole, unmap_later

READY, FAILED = 1, 2  # a stripe's state in the ready map; 0, pending, is what a new map is filled with


class ReadyMap:
    """The node's stripe states in a small shared file: a 32-byte header (ranks done, stripes, ranks that opened the
    stages, where the stages are), per stripe the ranks done with it (2 bytes) and its state (1 byte); `staged`,
    each file's stage: the node's bytes of it, fetched once into shared memory."""

    HEADER = 32
    SHM, TEMP = 1, 2  # where the stages are: shm_dir(), or the temporary directory where that has no room

    def __init__(self, load_id: str, sched: NodeSchedule, staged: bool = False):
        import numpy as np

        node = "".join(c for c in sched.node if c.isalnum())[:16] or "node"
        self.prefix = os.path.join(shm_dir(), f"raylazy-{load_id}-{node}")
        self.path, self.ranks, self.staged, self.sched = f"{self.prefix}.ready", len(sched.ranks), staged, sched
        n = len(sched.stripes)
        size = self.HEADER + 3 * n
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with _locked(self.fd):
                have = os.fstat(self.fd).st_size
                if have == 0:  # the first rank here: size it (zero-filled: every stripe pending)
                    os.ftruncate(self.fd, size)
                    os.pwrite(self.fd, n.to_bytes(8, "little"), 8)
                    os.pwrite(self.fd, self._room().to_bytes(8, "little"), 24)
                elif have != size or int.from_bytes(os.pread(self.fd, 8, 8), "little") != n:
                    raise ReadError(f"{self.path}: a ready map of another schedule ({have} bytes, {size} expected); "
                                    "two loads share a load id: load again")
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        where = int.from_bytes(self.mm[24:32], "little")  # the first rank's choice
        self.folder = shm_dir() if where == self.SHM else tempfile.gettempdir()
        self.counts = np.frombuffer(self.mm, dtype=np.uint16, count=n, offset=self.HEADER)
        self.flags = np.frombuffer(self.mm, dtype=np.uint8, offset=self.HEADER + 2 * n)
        self.stages: dict[int, int] = {}  # file -> its stage's descriptor
        self._stage_maps: dict = {}

    def _room(self) -> int:
        """Where the stages go: shm_dir() where it has room for the node's bytes, else the temporary directory."""
        if not self.staged:
            return 0
        free = os.statvfs(shm_dir())
        return self.SHM if free.f_bavail * free.f_frsize >= self.sched.staged_bytes else self.TEMP

    def _stage_path(self, f: int) -> str:
        return os.path.join(self.folder, f"{os.path.basename(self.prefix)}-{f}.stage")

    def stage(self, plan: RankPlan) -> dict:
        """Each file of the node's stripes as a uint8 tensor over a shared mapping of its stage ({file: tensor}),
        created (sparse, the file's size) by the first rank; the last of the node's ranks to open them removes
        their names (their memory lives while a rank maps them: a rank killed leaves nothing behind)."""
        import numpy as np
        import torch

        for f in sorted({s.file for s in self.sched.stripes}):
            fd = self.stages[f] = os.open(self._stage_path(f), os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, plan.files[f].size)  # the same size from every rank: sparse, nothing allocated
            self._stage_maps[f] = torch.from_numpy(np.frombuffer(mmap.mmap(fd, plan.files[f].size), dtype=np.uint8))
        with _locked(self.fd):
            opened = int.from_bytes(os.pread(self.fd, 8, 16), "little") + 1
            os.pwrite(self.fd, opened.to_bytes(8, "little"), 16)
        if opened == self.ranks:
            self._unlink_stages()
        return dict(self._stage_maps)

    def reserve(self, s):
        """Stripe `s`'s bytes in its file's stage, allocated (a write through a mapping into a full tmpfs would be a
        SIGBUS): the array its reader fills."""
        try:
            os.posix_fallocate(self.stages[s.file], s.start, s.end - s.start)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            free = os.statvfs(self.folder)
            raise ConfigurationError(
                f"{self._stage_path(s.file)}: no room to stage bytes {s.start}-{s.end} of file {s.file} of node "
                f"{self.sched.node}'s read ({self.sched.staged_bytes} bytes in all, "
                f"{free.f_bavail * free.f_frsize} free): give {shm_dir()} more room, or read with "
                "backend='exchange'") from None
        staged = self._stage_maps[s.file][s.start : s.end]
        prefault(staged.data_ptr(), s.end - s.start)
        return staged.numpy()

    def release(self, stripes) -> None:
        """This rank is done with `stripes` (copied its keeps out of them); a stripe every rank is done with has its
        stage's memory given back (staged only)."""
        if not self.staged or not stripes:
            return
        with _locked(self.fd):
            self.counts[stripes] += 1
            free = [i for i in stripes if self.counts[i] == self.ranks]
        for i in free:
            s = self.sched.stripes[i]
            punch_hole(self.stages[s.file], s.start, s.end - s.start)

    def mark(self, i: int) -> None:
        self.flags[i] = READY

    def fail(self, stripes) -> None:
        """Mark those of `stripes` not yet ready as failed."""
        for i in stripes:
            if self.flags[i] != READY:
                self.flags[i] = FAILED

    def done(self) -> None:
        """Count this rank done; the last of the node's ranks removes the file (and the stages' names, if a rank
        failed before it opened them)."""
        with _locked(self.fd):
            count = int.from_bytes(os.pread(self.fd, 8, 0), "little") + 1
            os.pwrite(self.fd, count.to_bytes(8, "little"), 0)
            if count >= self.ranks:
                os.unlink(self.path)
                if self.staged:
                    self._unlink_stages()
        for fd in self.stages.values():
            os.close(fd)
        self.stages.clear()
        unmap_later(self._stage_maps)
        os.close(self.fd)
        self.flags = self.counts = None
        self.mm.close()

    def _unlink_stages(self) -> None:
        for f in {s.file for s in self.sched.stripes}:
            try:
                os.unlink(self._stage_path(f))
            except FileNotFoundError:
                pass


class _locked:
    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def remove_ready_maps(load_id: str) -> None:
    """Remove this node's ready maps and stages of load `load_id` (after the load failed; those already gone are
    skipped)."""
    prefix = f"raylazy-{load_id}-"
    for folder in {shm_dir(), tempfile.gettempdir()}:
        for name in os.listdir(folder):
            if name.startswith(prefix) and name.endswith((".ready", ".stage")):
                try:
                    os.unlink(os.path.join(folder, name))
                except FileNotFoundError:
                    pass


def shm_dir() -> str:
    """Where node-shared files go: /dev/shm, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
