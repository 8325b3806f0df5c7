"""Which kind of storage a local path is on (`storage_kind`): the mount holding it, found in the process's mount table
(/proc/self/mountinfo: the longest mount point that is a prefix of the path), named by its file system type, or,
where the table cannot be read, by the magic number `statfs` reports.

The type alone says whether reads cross a network and whether the node's processes share the pages read; some
kinds depend on their mount: 9p shares pages only when mounted with a cache mode, SMB unless mounted `cache=none`,
and a FUSE file system shares them unless it opens its files with direct_io (an uncached bucket mount, mountpoint-s3's default), which the
kernel shows by refusing a shared mapping of a file (ENODEV): a checkpoint file on a FUSE mount is probed that way
(an mmap that touches no page: no read reaches the storage).

A network mount's request size and depth are the kernel's where the mount table or sysfs say them (`kernel_shape`);
where every read reaches the storage and the kernel says no depth, a few timed reads find its wait and depth
(`raylazy.storage.probe`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
from typing import NamedTuple

from ..core.kinds import StorageKind
from . import probe


class Mount(NamedTuple):
    """One line of a mount table (/proc/self/mountinfo)."""

    mount_point: str
    fs_type: str
    source: str
    options: frozenset[str]  # the mount's and the super block's options, e.g. "cache=none"
    device: str = ""  # major:minor of its file system, e.g. "0:41"


#: Kind, whether reads cross a network, whether the node shares pages read, by file-system type.
_TYPES: dict[str, tuple[str, bool, bool]] = {
    **{t: ("local", False, True) for t in ("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs",
                                           "reiserfs", "vfat", "exfat", "ntfs3", "squashfs", "erofs", "iso9660")},
    "fuseblk": ("local", False, True),  # a FUSE driver of a local block device (ntfs-3g)
    "tmpfs": ("tmpfs", False, True),
    "ramfs": ("tmpfs", False, True),
    "overlay": ("overlay", False, True),  # a container's root: the pages are its layers', kept by the kernel
    "nfs": ("nfs", True, True),
    "nfs4": ("nfs", True, True),
    "lustre": ("lustre", True, True),
    "gpfs": ("gpfs", True, True),  # GPFS caches in its pagepool, shared by the node
    # BeeGFS's default (buffered) cache mode keeps a small buffer per open file, not the page cache; its native
    # mode, set in beegfs-client.conf and not visible in the mount table, uses the page cache.
    "beegfs": ("beegfs", True, False),
    "ceph": ("cephfs", True, True),
    "cifs": ("smb", True, True),
    "smb3": ("smb", True, True),
    "9p": ("9p", True, False),  # a VM's shared directory: its mount's cache mode decides (kind_of)
    "virtiofs": ("virtiofs", True, True),
    "wekafs": ("wekafs", True, True),
}

#: FUSE file systems by name (the mount table's "fuse.NAME"): kind, and whether reads cross a network.
_FUSE: dict[str, tuple[str, bool]] = {
    "gcsfuse": ("gcsfuse", True),
    "mountpoint-s3": ("mountpoint-s3", True),
    "juicefs": ("juicefs", True),
    "blobfuse2": ("blobfuse2", True),
    "blobfuse": ("blobfuse2", True),
    "s3fs": ("s3fs", True),
    "goofys": ("goofys", True),
    "rclone": ("rclone", True),
    "ceph-fuse": ("cephfs", True),
    "lxcfs": ("lxcfs", False),
    "fuse-overlayfs": ("overlay", False),
    "sshfs": ("sshfs", True),
}

#: The C library, from the symbols already loaded (ctypes.util.find_library would run and read ldconfig: a
#: reader's process must read nothing but the checkpoint).
_LIBC = ctypes.CDLL(None, use_errno=True)
FUSE_MAGIC = 0x65735546
#: statfs f_type magic numbers (linux/magic.h and the file systems' own sources) and the type each stands for.
MAGIC: dict[int, str] = {
    0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x2FC12FC1: "zfs", 0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs", 0x73717368: "squashfs", 0xE0F5E1E2: "erofs", 0x01021994: "tmpfs", 0x858458F6: "ramfs",
    0x794C7630: "overlay", 0x6969: "nfs", 0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0x19830326: "beegfs",
    0x00C36400: "ceph", 0xFF534D42: "cifs", 0xFE534D42: "smb3", 0x01021997: "9p",
    FUSE_MAGIC: "fuse",  # every FUSE file system, virtiofs too: only the mount table tells them apart
}


def _unescape(field: str) -> str:
    """A mount table field with its octal escapes (space, tab, newline, backslash) undone."""
    if "\\" not in field:
        return field
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a /proc/PID/mountinfo, in its order (a later mount on the same point covers the earlier)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        fs_type, source, super_opts = (fields[sep + 1 : sep + 4] + ["", ""])[:3]
        options = frozenset(fields[5].split(",")) | frozenset(super_opts.split(","))
        mounts.append(Mount(_unescape(fields[4]), fs_type, _unescape(source), options, fields[2]))
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding absolute `path`: the longest mount point that is `path` or a parent of it (the last in the
    table where mounts are stacked)."""
    best = None
    for m in mounts:
        mp = m.mount_point.rstrip("/")
        if (path == m.mount_point or path.startswith(mp + "/")) and (best is None or len(mp) >= len(best.mount_point.rstrip("/"))):
            best = m
    return best


def kind_of(fs_type: str, options: frozenset[str] = frozenset(), mount_point: str = "", source: str = "",
            direct_io: bool | None = None) -> StorageKind:
    """The kind a file system of type `fs_type` (as the mount table names it) mounted from `source` with `options`
    is; `direct_io`: whether a FUSE file system's file refused a shared mapping (None: not probed)."""
    if fs_type == "fuse" or fs_type.startswith("fuse."):
        # FUSE names itself by subtype ("fuse.gcsfuse") or, without one, by its source (mountpoint-s3, blobfuse2)
        daemon = fs_type.partition(".")[2] or source.partition(":")[0].lower()
        name, network = _FUSE.get(daemon, ("fuse", True))
        # Not probed: mountpoint-s3 opens files with direct_io unless given a cache; most others keep pages.
        uncached = direct_io if direct_io is not None else name == "mountpoint-s3"
        return StorageKind(name=name, fs_type=fs_type, network=network, page_cache=not uncached,
                           mount_point=mount_point)
    # An unknown type is taken for network storage that keeps pages, as NFS does: reads shaped for it (many in
    # flight) cost a local disk nothing.
    name, network, page_cache = _TYPES.get(fs_type, (fs_type or "unknown", True, True))
    if name == "9p":  # 9p's default is cache=none, and the table shows a cache mode only where one was set
        page_cache = any(o.startswith("cache=") and o != "cache=none" for o in options)
    elif name == "smb":  # SMB's default is cache=strict
        page_cache = "cache=none" not in options
    return StorageKind(name=name, fs_type=fs_type, network=network, page_cache=page_cache, mount_point=mount_point)


def statfs_type(where: str | int) -> int | None:
    """The magic number of the file system holding `where` (a path, or an open descriptor): statfs's f_type; None
    where it cannot be had."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    failed = _LIBC.fstatfs(where, buf) if isinstance(where, int) else _LIBC.statfs(os.fsencode(where), buf)
    return None if failed else ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def refuses_shared_map(fd: int) -> bool:
    """Whether open file `fd` refuses a shared read-only mapping with ENODEV, as a FUSE file opened with direct_io
    does (the mapping touches no page: nothing is read)."""
    try:
        with mmap.mmap(fd, mmap.PAGESIZE, access=mmap.ACCESS_READ):
            return False
    except OSError as e:
        return e.errno == errno.ENODEV
    except ValueError:  # an empty file: nothing to map, nothing to tell
        return False


def direct_io(fd: int) -> bool:
    """Whether open file `fd` is on a FUSE mount that serves it with direct_io: no page of it is kept, so every
    read reaches the storage and a hint to read ahead (POSIX_FADV_WILLNEED) fetches pages no read will use."""
    return statfs_type(fd) == FUSE_MAGIC and refuses_shared_map(fd)


def _first_file(path: str) -> str | None:
    """`path` if a file, else the first safetensors file of directory `path` (None: none)."""
    try:
        if os.path.isfile(path):
            return path
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    except OSError:
        return None
    return os.path.join(path, names[0]) if names else None


def _probed(file: str | None) -> bool | None:
    """Whether `file` (a checkpoint file) is served with direct_io (None: no file to tell by)."""
    if file is None:
        return None
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return None
    try:
        return refuses_shared_map(fd)
    finally:
        os.close(fd)


def storage_kind(path: str, mountinfo: str | None = None, uncached: bool | None = None,
                 resolve: bool = True) -> StorageKind:
    """The kind of storage `path` (a file or directory) is on; `mountinfo`: a mount table's text (default: this
    process's); `uncached`: whether a file there is served with direct_io, where known (else a FUSE mount's
    file is probed); `resolve=False`: take the path as it is, without following its links (nothing on its mount
    is then touched). A network mount's request size and depth are the kernel's where it says them
    (`kernel_shape`); where every read reaches the storage and the kernel says no depth, a probe of its first
    checkpoint file times its wait and depth, once a mount for the process (`raylazy.storage.probe`)."""
    path = os.path.realpath(path) if resolve else path
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            mountinfo = ""
    mount = mount_of(path, parse_mountinfo(mountinfo))
    if mount is None:  # no mount table (not Linux's /proc): the magic number, without a mount's options
        return kind_of(MAGIC.get(statfs_type(path) or 0, "unknown"))
    fuse = mount.fs_type == "fuse" or mount.fs_type.startswith("fuse.")
    first = functools.cache(lambda: _first_file(path))  # listed once, and only where needed
    probed = (uncached if uncached is not None else _probed(first())) if fuse else None
    kind = kind_of(mount.fs_type, mount.options, mount.mount_point, mount.source, probed)
    if not kind.network:
        return kind
    request_bytes, depth = kernel_shape(mount, fuse, kind.page_cache)
    latency_s = 0.0
    if resolve and not kind.page_cache and not depth and (measured := probe.probed(mount.mount_point, mount.device,
                                                                                   first)):
        latency_s, depth = measured
    return kind.model_copy(update={"request_bytes": request_bytes, "depth": depth, "latency_s": latency_s})


def kernel_shape(mount: Mount, fuse: bool, cached: bool = True, sysfs: str = "/sys") -> tuple[int, int]:
    """(request bytes, requests in flight) the kernel reads network mount `mount` with, 0 for either it does not
    say. NFS: `rsize` from its options (the size of its READs). A FUSE mount keeping its pages (`cached`): its
    read-ahead (its bdi's read_ahead_kb, the size of the requests a buffered read makes), at most its `max_read`
    where set, and the connection's `max_background` (the asynchronous requests it keeps in flight:
    /sys/fs/fuse/connections/MINOR); one serving direct_io passes each read on as it is asked (up to the
    connection's request size, which sysfs does not show): nothing said. Nothing on the mount is touched: the mount
    table and sysfs only."""
    options = dict(o.split("=", 1) for o in mount.options if "=" in o)
    if not fuse:
        return _int(options.get("rsize")), 0
    if not cached:
        return 0, 0
    read_ahead = _int(_read(f"{sysfs}/class/bdi/{mount.device}/read_ahead_kb")) * 1024
    max_read = _int(options.get("max_read"))
    minor = mount.device.partition(":")[2]
    return min(read_ahead, max_read or read_ahead), _int(_read(f"{sysfs}/fs/fuse/connections/{minor}/max_background"))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _int(text: str | None) -> int:
    try:
        return max(0, int((text or "").strip()))
    except ValueError:
        return 0
