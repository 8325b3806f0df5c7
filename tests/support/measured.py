"""What the system saw a reader do, measured outside raylazy's readers: the file bytes a process's read and
populate system calls covered (recorded in the process itself), and a cold page cache. A process's I/O counters
(/proc/<pid>/io) are read by `raylazy.io.stats.proc_io`, and `io_delta` gives rchar (bytes read calls returned,
from storage or the page cache alike; mapped pages do not count) and read_bytes (bytes the process made storage
deliver: its read calls and its page faults alike, 0 on a warm cache) between two readings.

- `SyscallLog`: installed in a rank's process (a forked one), it records every `os.pread`/`os.preadv` and every
  MADV_POPULATE_READ of raylazy's cooperative reader as (file, start, end), the file found from the descriptor or
  the mapping (/proc/self/maps). Two simulated nodes share one page cache, so what each node's ranks asked of
  the kernel is the one thing that tells them apart.
- `cold`: the files' pages evicted (posix_fadvise DONTNEED after fsync, `benchmarks.loaders.pagecache`), so that a
  process's read_bytes are its reads from storage; where that cannot be done (no block device: tmpfs), why not.
"""

from __future__ import annotations

import os

PAGE = os.sysconf("SC_PAGE_SIZE")


def header_bytes(path: str) -> int:
    """8 + N: what `open_verified` reads of a file to check its header digest before a reader reads it."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def assert_header_checks_only(preads, plan) -> None:
    """The (path, start, end) `os.pread`s of a reader's process in `plan`'s files lie in their headers (the
    `open_verified` check)."""
    sizes = {os.path.realpath(f.uri): header_bytes(f.uri) for f in plan.files}
    for path, _, end in preads:
        assert end <= sizes.get(path, end), f"{path}: read up to byte {end}, past its header"


def _mapped_file(addr: int) -> tuple[str, int]:
    """(path, file offset) of address `addr` in this process's file mappings."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi and len(fields) == 6:
                return fields[5].strip(), addr - lo + int(fields[2], 16)
    raise AssertionError(f"address {addr:#x} is in no file mapping")


class SyscallLog:
    """The file ranges this process's read calls returned, as (path, start, end): `preadv` (`os.preadv`: the readers'
    data), `pread` (`os.pread`: the header checks), and `populated` (the cooperative stripe readers'
    MADV_POPULATE_READ calls). `install()` wraps the calls for good (in a forked rank: nothing to undo)."""

    def __init__(self):
        self.preadv: list[tuple[str, int, int]] = []
        self.pread: list[tuple[str, int, int]] = []
        self.populated: list[tuple[str, int, int]] = []

    def install(self) -> SyscallLog:
        import raylazy.io.mapping as mapping

        log, pread, preadv, libc = self, os.pread, os.preadv, mapping._libc

        def logged_pread(fd, n, offset):
            data = pread(fd, n, offset)
            log.pread.append((os.readlink(f"/proc/self/fd/{fd}"), offset, offset + len(data)))
            return data

        def logged_preadv(fd, buffers, offset, *flags):
            got = preadv(fd, buffers, offset, *flags)
            log.preadv.append((os.readlink(f"/proc/self/fd/{fd}"), offset, offset + got))
            return got

        class Libc:
            @staticmethod
            def madvise(addr, length, advice):
                if advice == mapping._POPULATE:
                    path, offset = _mapped_file(addr)
                    log.populated.append((path, offset, offset + length))
                return libc.madvise(addr, length, advice)

            def __getattr__(self, name):  # the other calls as they are
                return getattr(libc, name)

        os.pread, os.preadv, mapping._libc = logged_pread, logged_preadv, Libc()
        return self


def pages(ranges) -> list[tuple[str, int]]:
    """Every (path, page index) the (path, start, end) ranges touch, once per range that touches it."""
    return [(path, p) for path, start, end in ranges if end > start for p in range(start // PAGE, (end - 1) // PAGE + 1)]


def needed_pages(plan, ranks) -> set[tuple[str, int]]:
    """The (path, page index) holding any byte the shards of `ranks` need: their reads' ranges (`planlib.read_ranges`;
    test_planner checks that they give each rank its slice)."""
    from tests.support.planlib import read_ranges

    return set(pages((os.path.realpath(plan.files[r.file].uri), off, off + n) for rank in ranks for t in plan.ranks[rank].tensors
                     for r in t.reads for off, _, n in read_ranges(r)))


def cold(paths: list[str]) -> str | None:
    """Evict `paths` from the page cache: None when none of their pages is left, else why it could not be done."""
    from benchmarks.loaders.diskstats import Device
    from benchmarks.loaders.pagecache import evict

    device = Device(paths)
    if device.name is None:
        return f"cannot start from a cold cache: {device.missing}"
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
        finally:
            os.close(fd)
    left = evict(paths, timeout_s=1.0)  # pages stay while a process maps them
    return f"{left} bytes of the files stayed in the page cache" if left else None
