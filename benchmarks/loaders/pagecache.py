"""Page-cache control for cold and warm runs: evict a file's pages, count resident ones, pull them in, hold them.

Eviction is `posix_fadvise(POSIX_FADV_DONTNEED)`, which drops a file's clean,
unmapped pages (no `drop_caches`: other processes' caches stay). Residency is
`mincore(2)` on a fresh PROT_READ mapping of the file (`raylazy.io.mapping.pages_in_cache`), which faults nothing in.
Holding is `mlock(2)` on such a mapping: a proactive reclaim (DAMON's pageout,
which some virtual machines run) takes idle pages of a cached file within
seconds, and a run that starts later would read them back one fault at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import sys
import time

from raylazy.io.mapping import pages_in_cache

PAGE = os.sysconf("SC_PAGE_SIZE")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_READ, _MAP_SHARED, _MAP_FAILED = 1, 1, ctypes.c_void_p(-1).value


def resident_bytes(path: str) -> int:
    """Bytes of `path` in the page cache (whole pages; the last one counted in full)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            if err == errno.ENODEV:  # a FUSE file served with direct_io: the kernel keeps none of its pages
                return 0
            raise OSError(err, f"mmap {path}")
        try:
            pages = pages_in_cache(addr, size)
            if pages is None:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return pages * PAGE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def resident(paths: list[str]) -> int:
    return sum(resident_bytes(p) for p in paths)


def evict(paths: list[str], timeout_s: float = 10.0) -> int:
    """Drop the files' pages from the page cache; returns the bytes still resident (0 when it worked).

    Retries while pages stay (a process that just exited may still map them).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = resident(paths)
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def warm(paths: list[str]) -> int:
    """Read the files whole so every page is cached; returns the bytes resident afterwards."""
    buf = bytearray(16 << 20)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while n := os.preadv(fd, [buf], off):
                off += n
        finally:
            os.close(fd)
    return resident(paths)


@contextlib.contextmanager
def held(paths: list[str]):
    """The files in the page cache, read where they are not, and held there until the block ends: each mapped and
    locked (mlock, which reads what is missing). Where locking is refused (RLIMIT_MEMLOCK, not root) or a file
    cannot be mapped, it is read once instead, with a warning: cached only as long as nothing reclaims it."""
    maps: list[tuple[int, int]] = []
    try:
        for p in paths:
            size = os.path.getsize(p)
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0) if size else None
            finally:
                os.close(fd)
            if addr not in (None, _MAP_FAILED):
                maps.append((addr, size))
            if size and (addr in (None, _MAP_FAILED) or _libc.mlock(addr, size) != 0):
                print(f"warning: cannot hold {p} in the page cache ({os.strerror(ctypes.get_errno())}): read once "
                      "instead, and a reclaim may take pages before the run uses them", file=sys.stderr)
                warm([p])
        yield
    finally:
        for addr, size in maps:
            _libc.munmap(addr, size)  # unlocks
