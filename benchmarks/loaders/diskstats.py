"""Reads of the block device that holds the checkpoint, from /proc/diskstats: what the node pulled from storage.

The block layer counts every request it completes once, whichever process (or
kernel thread) caused it, so the delta around a run is the node's total as the
device saw it: sectors read x 512, read requests (after the block layer merged
adjacent ones; merges counted apart) and so the mean request size. It also counts
reads of other files on the device (other processes on a shared machine), so a
quiet device is assumed. Per-process `read_bytes` (/proc/PID/io) is charged to the
process that submitted the I/O: it cannot tell a node's total from the reads of
other processes, and misses reads submitted by kernel threads or the Ray driver.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size


@dataclass(frozen=True)
class Reads:
    """Read counters of one device (cumulative, or a difference of two readings)."""

    requests: int
    merged: int
    bytes: int

    def __sub__(self, other: Reads) -> Reads:
        return Reads(self.requests - other.requests, self.merged - other.merged, self.bytes - other.bytes)

    def __add__(self, other: Reads) -> Reads:
        return Reads(self.requests + other.requests, self.merged + other.merged, self.bytes + other.bytes)

    @property
    def mean_request(self) -> float | None:
        return self.bytes / self.requests if self.requests else None


def _line(major: int, minor: int) -> list[str] | None:
    with open("/proc/diskstats") as fh:
        for line in fh:
            f = line.split()
            if int(f[0]) == major and int(f[1]) == minor:
                return f
    return None


class Device:
    """The block device holding all of `paths` (its partition's line when they are on a partition).

    `name` is None when there is no one such line: the files lie on several devices, or on a file
    system without a block device of its own (overlayfs, btrfs, tmpfs, NFS, FUSE); `missing` says why.
    """

    def __init__(self, paths: list[str]):
        devs = {os.stat(p).st_dev for p in paths}
        self.major, self.minor = os.major(min(devs)), os.minor(min(devs))
        self.name, self.missing = None, None
        if len(devs) > 1:
            self.missing = f"the checkpoint's files lie on {len(devs)} devices"
            return
        try:
            f = _line(self.major, self.minor)
        except OSError as e:
            self.missing = f"/proc/diskstats unreadable ({e})"
            return
        if f is None:
            self.missing = (f"no /proc/diskstats line for device {self.major}:{self.minor} holding {paths[0]} (a file "
                            "system without a block device of its own, e.g. overlayfs, btrfs, tmpfs or NFS)")
        else:
            self.name = f[2]

    def _fields(self) -> list[str]:
        f = _line(self.major, self.minor)
        if f is None:
            raise OSError(f"device {self.name} ({self.major}:{self.minor}) left /proc/diskstats")
        return f

    def reads(self) -> Reads:
        f = self._fields()
        return Reads(requests=int(f[3]), merged=int(f[4]), bytes=int(f[5]) * SECTOR)

    def settled_reads(self, timeout_s: float = 2.0) -> Reads:
        """The counters once the device has no read in flight (asynchronous read-ahead that a process did not
        wait for completes, and is counted, after the process returns), or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._reads_in_flight() and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.reads()

    def _reads_in_flight(self) -> int:
        try:
            with open(f"/sys/dev/block/{self.major}:{self.minor}/inflight") as fh:
                return int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            return 0  # no such counter: nothing to wait for


def refaulted_bytes() -> int:
    """Bytes of file pages the kernel read again after evicting them (/proc/vmstat workingset_refault_file, a
    machine-wide count since boot; 0 where the kernel does not keep it). Around a run, a rise means some of the
    device's reads were the same pages twice: the page cache evicted them between their read-ahead and their use
    (memory pressure, or proactive reclaim such as DAMON's pageout, /sys/kernel/mm/damon)."""
    try:
        with open("/proc/vmstat") as fh:
            counts = dict(line.split() for line in fh)
    except OSError:
        return 0
    return int(counts.get("workingset_refault_file", 0)) * os.sysconf("SC_PAGE_SIZE")
