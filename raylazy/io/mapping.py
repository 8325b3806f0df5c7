"""Files as memory maps: a local file's whole mapping as a tensor (`mapped`), a region's box as a view of it
(`mapped_box`, where `box_mappable`), its pages brought into the page cache ahead of the copies out of it
(`populate`, `populating`; written ones' page tables filled ahead, `prefault`), asked whether they are there
(`pages_in_cache`, `in_page_cache`, `cached_share`), unmapped off the caller's thread (`unmap_later`), and a
file's memory given back (`punch_hole`). The cooperative backend, its stages and the serving of regions use them."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..core.boxes import Region
from ..core.dtypes import itemsize, torch_dtype
from ..storage import LocalSource

#: madvise(MADV_POPULATE_READ) (Linux >= 5.14; Python's mmap module lacks the constant); 0 once it failed.
_POPULATE = getattr(mmap, "MADV_POPULATE_READ", 22)
#: libc's madvise through ctypes, which releases the GIL during the call (mmap.madvise holds it: a reader
#: thread waiting on storage there stalled the keeper thread of its process for the whole read).
_libc = ctypes.CDLL(None, use_errno=True)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
#: fallocate(2)'s FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE.
_PUNCH_HOLE = 0x01 | 0x02
#: mincore's byte per page -> 1 where its low bit (in the page cache) is set, else 0 (the other bits are reserved).
_IN_CACHE = bytes(i & 1 for i in range(256))


def populate(source: LocalSource, s, maps: dict[int, tuple[mmap.mmap, int]]) -> bool:
    """Bring stripe `s` into the page cache through a read-only mapping of its file (kept in `maps`); False where
    the kernel cannot (before Linux 5.14), and from then on in this process.

    MADV_POPULATE_READ, called through ctypes so the GIL is released while the kernel reads: the kernel reads
    the stripe in large requests and nothing is copied to user space, which a read into a buffer would do."""
    import numpy as np

    global _POPULATE
    if not _POPULATE:
        return False
    try:
        if s.file not in maps:
            mm = mmap.mmap(source.fd, 0, access=mmap.ACCESS_READ)
            maps[s.file] = (mm, np.frombuffer(mm, dtype=np.uint8).ctypes.data)  # the array is dropped at once
        if _libc.madvise(maps[s.file][1] + s.start, s.end - s.start, _POPULATE):  # page-aligned
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _POPULATE = 0  # not supported here: read into a scratch buffer
        return False


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give back the memory of bytes [offset, offset + length) of a file in memory (a tmpfs file: its pages are
    dropped, reading as zeros); best effort: where the file system cannot, it is given back when the file goes."""
    _libc.fallocate(fd, _PUNCH_HOLE, offset, length)


def prefault(address: int, length: int) -> None:
    """Fill the page tables of `length` bytes of a shared writable mapping from `address` (page-aligned) before they
    are written (madvise MADV_POPULATE_WRITE, Linux >= 5.14): one call instead of a page fault a page; best effort."""
    _libc.madvise(address, length, _POPULATE_WRITE)


def populates() -> bool:
    """Whether `populate` brings pages in here (Linux >= 5.14, and it has not failed for want of it yet)."""
    return bool(_POPULATE)


def mapped(source: LocalSource):
    """The whole of a local file as a uint8 tensor over a private read-only mapping (pages shared with the page
    cache: read once for the node, as they are first used)."""
    import numpy as np
    import torch

    mm = mmap.mmap(source.fd, 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable views, nothing ever written
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))


@contextmanager
def mapped_files(sources: dict) -> Iterator[dict]:
    """Each of `sources` `mapped` ({file: mapping}); on leaving, unmapped on a thread (`unmap_later`)."""
    maps = {f: mapped(s) for f, s in sources.items()}
    try:
        yield maps
    finally:
        unmap_later(maps)


def unmap_later(maps: dict) -> None:
    """Unmap the files mapped in `maps` (its values hold the last references to their `mapped` tensors or mmap
    objects), emptied at once, on a thread of its own, which ends with it: the kernel's teardown of a mapping's
    page tables grows with the pages the copies touched, and the caller need not wait for it. Each mapping's close
    lets go of the GIL while the kernel unmaps it."""
    held = list(maps.values())
    maps.clear()  # before the thread starts: the thread's list holds the last references, so it unmaps them
    if held:
        threading.Thread(target=held.clear, name="raylazy-unmap").start()


def mapped_box(mapping, region: Region, base: int = 0):
    """The region's box (`raylazy.core.boxes.Region`) as a view of its file's mapping (`mapped`; or of a part of the
    file from byte `base` on), in its dtype and shape: nothing is read until its bytes are used. Only for a region
    `box_mappable` says a view shows."""
    t = region.tensor
    full = mapping[t.start - base : t.end - base].view(torch_dtype(t.dtype)).view(t.shape)
    return full[tuple(slice(a, a + n) for a, n in zip(region.starts, region.sizes))]


@contextmanager
def populating(spans: list[tuple], threads: int, chunk_bytes: int,
               ahead: int | None = None) -> Iterator[Callable[[int], None]]:
    """`threads` threads bringing byte spans of files' mappings into memory ahead of the copies out of them: each
    (mapping from `mapped`, first byte, end byte), in the order given, cut into chunks of `chunk_bytes`, each one
    madvise(MADV_POPULATE_READ) of the mapping itself: large requests, several in flight, and the page tables
    filled (a copy out of the mapping then takes no page fault). A page a copy needs first is read by the copy's
    own fault; a populate cannot go wrong but early: where the kernel cannot (before Linux 5.14) or one fails, the
    threads stop and the copies read the rest. On leaving, they stop after their current chunk. A chunk already
    in the page cache is left to the copies (`in_page_cache`): populating it would read nothing and take the
    copies' core (a vLLM worker is bound to its cores), so where all of it is there no thread starts.

    Yields `reached(address)`, which a copy calls with the address of its first byte in a mapping: no chunk more
    than `ahead` chunks (default 2 x `threads`) past the furthest chunk reached is populated (before any copy,
    the first `ahead`). A populated page no process has touched yet looks unused to the kernel, among the first
    it evicts: under memory pressure, or a proactive reclaim such as DAMON's pageout, pages brought in long
    before their copy were evicted and read from storage a second time (a third more bytes than the checkpoint
    at tp=2)."""
    stop, moved = threading.Event(), threading.Condition()
    chunks = [(m.data_ptr(), a, min(hi, a + chunk_bytes)) for m, lo, hi in spans
              for a in range(lo - lo % mmap.PAGESIZE, hi, chunk_bytes)]
    chunks = [(base, a, b) for base, a, b in chunks if not in_page_cache(base + a, b - a)]
    by_address = sorted((base + a, base + b, i) for i, (base, a, b) in enumerate(chunks))
    starts, window, furthest = [c[0] for c in by_address], ahead or 2 * threads, -1  # furthest chunk reached
    todo = iter(enumerate(chunks))

    def reached(address: int) -> None:
        nonlocal furthest
        k = bisect_right(starts, address) - 1
        if k >= 0 and address < by_address[k][1] and by_address[k][2] > furthest:
            with moved:
                furthest = max(furthest, by_address[k][2])
                moved.notify_all()

    def populate() -> None:
        for i, (base, a, b) in todo:  # next() on a shared iterator is atomic under the GIL
            with moved:
                while not stop.is_set() and i > furthest + window:
                    moved.wait()
            if stop.is_set() or not _POPULATE or _libc.madvise(base + a, b - a, _POPULATE):
                return

    workers = [threading.Thread(target=populate, name="raylazy-populate", daemon=True)
               for _ in range(min(threads, len(chunks)))]
    for w in workers:
        w.start()
    try:
        yield reached
    finally:
        stop.set()
        with moved:
            moved.notify_all()
        for w in workers:
            w.join()


def pages_in_cache(address: int, length: int) -> int | None:
    """How many pages of `length` bytes of a file's mapping from `address` (page-aligned) are in the page cache
    (mincore(2)); None where it fails."""
    pages = (ctypes.c_char * -(-length // mmap.PAGESIZE))()
    return None if _libc.mincore(address, length, pages) else bytes(pages).translate(_IN_CACHE).count(1)


def in_page_cache(address: int, length: int) -> bool:
    """Whether every page of `length` bytes of a file's mapping from `address` (page-aligned) is in the page cache
    (False where mincore fails)."""
    return pages_in_cache(address, length) == -(-length // mmap.PAGESIZE)


def cached_share(address: int, length: int, every: int = 2 << 20, most: int = 64) -> float:
    """The share of a file's mapping from `address` (page-aligned), `length` bytes, in the page cache, by a sample:
    one page every `every` bytes, or `most` pages evenly spread over a larger file, and the last (a mincore(2) of
    one page each; 0 where it fails). A mincore of every page, or of a page every `every` bytes however large the
    file, costs in proportion to the checkpoint (a page-cache lookup per page asked); the sample stays at
    `most` + 1 pages a file."""
    step = max(every, -(-length // most))
    step += -step % mmap.PAGESIZE  # whole pages: mincore takes page-aligned addresses
    at = list(range(address, address + length, step)) + [address + length - 1 - (length - 1) % mmap.PAGESIZE]
    return sum(pages_in_cache(a, 1) or 0 for a in at) / len(at)


def box_mappable(region: Region) -> bool:
    """Whether `mapped_box` shows the region (whole elements, aligned in the file)."""
    size = itemsize(region.tensor.dtype)
    return bool(size) and region.tensor.start % size == 0
