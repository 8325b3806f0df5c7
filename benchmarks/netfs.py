"""An emulated network file system for the tests and benchmarks: a FUSE passthrough of a directory, served by a
process of its own, with one bandwidth budget shared by every file and reader (a token bucket), a fixed latency
per request, and the two ways network storage meets the kernel's page cache:

- `cached` (NFS-like: NFS, EFS, Filestore, Lustre, JuiceFS): the kernel keeps the pages it read (`keep_cache` on
  every open, attributes cached for `attr_timeout_s`, an hour by default: the files do not change), so every process of the node shares them and a second read of a range is
  served by the kernel, never reaching the storage;
- `direct` (an uncached bucket mount: gcsfuse or mountpoint-s3 without a cache): every open is `direct_io`, so
  every read is a request to the storage, and a shared `mmap` of a file fails with ENODEV (the kernel cannot keep
  a shared mapping coherent with pages it does not hold).

The server counts the read requests and bytes it served, per file and in all, and the most requests it was
serving at once. Processes reach them through the mount itself: a control directory, `/.netfs/`, absent from
listings, holds `stats` (JSON, read afresh on every open, never cached, never counted) and `control` (write a JSON
object to change `latency_s` or `bandwidth_bps` while mounted, `{"reset": true}` to zero the counts, `{"fault":
...}` to make reads stall, fail or come short, or `{"recover": true}` and `{"release": true}` for a server that comes
back with reads still blocked: `NetFS.control`), so
forked readers, Ray workers and the test process all see the same counts.

The binding is mfusepy, the maintained fork of fusepy (ctypes bindings of libfuse's high-level API): it loads
libfuse 3 (Debian's `fuse3`) with nothing to compile, and serves requests on libfuse's multi-threaded loop, one
thread per request in flight, which is what lets a latency per request overlap across requests as on a real
network file system. pyfuse3 and llfuse are Cython builds against libfuse's headers, and pyfuse3 serves on one
trio event loop; fusepy itself is unmaintained (last release 2018) and speaks only libfuse 2.

Parameters of real systems, and the emulator's (docs/network-storage.md has the reasoning): `PROFILES`. This Python
server on a 2-core machine, shared and busy, with no budget and no latency, serves a file read sequentially at
0.39-0.43 GB/s to one reader of the cached mode (128 KiB read-ahead requests) and 0.66-0.86 GB/s to four, at
0.72-0.85 GB/s to one reader of the direct mode (1 MiB requests) and 1.26-1.34 GB/s to four (the command:
docs/network-storage.md). So the emulated profiles keep the real systems' latency and page-cache behaviour and
scale their bandwidth down to 250 MB/s, a budget the server meets with room to spare.

    with NetFS(source_dir, mode="cached", latency_s=0.002, bandwidth_bps=250e6) as fs:
        ...read under fs.mountpoint...
        fs.stats()  # {"requests": ..., "bytes": ..., "files": {"/model.safetensors": {...}}, ...}

`NetFS.close()` unmounts (`fusermount3 -u`, lazily if the mount is still busy), waits for the server process to end
and removes the mount point; the server also mounts with `auto_unmount`, so a test session that dies leaves no
mount behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

#: The control directory at the mount's root (not listed).
CONTROL = "/.netfs"
#: How the kernel's page cache meets the mount (the module docstring).
MODES = ("cached", "direct")


@dataclass(frozen=True)
class Profile:
    """A network storage's parameters: the wait of each request, the bandwidth a client node gets (0: no budget),
    whether the kernel keeps pages (`cached`) or every read reaches the storage (`direct`), and the read-ahead
    that sizes a cached mount's requests (None: the kernel's 128 KiB)."""

    latency_s: float
    bandwidth_bps: float
    mode: str
    read_ahead_kb: int | None
    note: str

    def mount(self, source: str, **overrides) -> NetFS:
        """`source` mounted with these parameters (any of NetFS's keyword arguments overriding them)."""
        params = dict(mode=self.mode, latency_s=self.latency_s, bandwidth_bps=self.bandwidth_bps,
                      read_ahead_kb=self.read_ahead_kb)
        return NetFS(source, **(params | overrides))


#: Real systems (per client node, as their documentation and common measurements put them), and the emulator's
#: versions of them: the same latency and page-cache behaviour, bandwidth scaled to what the server can serve.
PROFILES = {
    "efs": Profile(0.0015, 500e6, "cached", 1024,
                   "EFS / Filestore over NFSv4.1: 1-2 ms a request, a few hundred MB/s a client, rsize 1 MiB"),
    "lustre": Profile(0.0003, 5e9, "cached", 4096, "Lustre: sub-ms RPCs of 1-4 MiB, GB/s a client across its OSTs"),
    "gcsfuse": Profile(0.030, 200e6, "direct", None,
                       "gcsfuse / mountpoint-s3 without a cache: tens of ms to first byte, ~100-200 MB/s a stream"),
    "emulated-nfs": Profile(0.002, 250e6, "cached", 1024, "the tests' NFS-like mount: EFS's latency at a 2-core budget"),
    "emulated-bucket": Profile(0.010, 250e6, "direct", None,
                               "the tests' uncached bucket mount: a bucket's latency scaled down like the budget"),
    "emulated-fuse": Profile(0.002, 250e6, "cached", None,
                             "a FUSE mount keeping its pages, asked the kernel's 128 KiB at a time (sshfs, blobfuse, "
                             "a bucket mount without prefetch): the NFS-like mount's latency and budget"),
}

#: The benchmarks' and tests' modes of the emulated mount: the profile each mounts with.
MODE_PROFILES = {"cached": "emulated-nfs", "direct": "emulated-bucket", "fuse": "emulated-fuse"}


class TokenBucket:
    """`rate` bytes a second for every caller together, with at most `burst` bytes sent ahead: a request takes its
    bytes (the bucket may go into debt) and waits until the debt is paid, so concurrent requests share the rate."""

    def __init__(self, rate: float, burst: float = 256 << 10):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - n
            self.at = now
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait:
            time.sleep(wait)


def fuse_problem() -> str | None:
    """Why a FUSE mount cannot be made here (None if it can): no /dev/fuse, no fusermount3, no mfusepy or libfuse."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is not available in this kernel or container)"
    if shutil.which("fusermount3") is None:
        return "no fusermount3: install Debian's fuse3 (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: mfusepy found no libfuse to load
        return f"mfusepy cannot load libfuse 3 ({e}): pip install mfusepy (the `test` extra) and apt-get install fuse3"
    return None


# --- the server (its own process: `python netfs.py SOURCE MOUNTPOINT --mode ...`) -----------------------------

def _serve(source: str, mountpoint: str, mode: str, latency_s: float, bandwidth_bps: float, max_threads: int,
           attr_timeout_s: float) -> None:
    import mfusepy

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def __init__(self):
            self.latency_s = latency_s
            self.bucket = TokenBucket(bandwidth_bps)
            self.fault: dict = {}  # {"stall" | "short" | "fail": ..., "after_bytes": n}: see NetFS.control
            self.answering = threading.Event()  # cleared while reads stall
            self.answering.set()
            self.held: list[threading.Event] = []  # the stalls of reads a `recover` left blocked, until `release`
            self.lock = threading.Lock()
            self.in_flight = 0
            self.reset()
            self.control_fhs: dict[int, bytes] = {}  # each open control file's handle -> what it reads

        def reset(self) -> None:
            with self.lock:
                self.counts = {"requests": 0, "bytes": 0, "meta_requests": 0, "most_in_flight": 0, "files": {},
                               "stalled_at": None}
                self.answered = 0  # bytes of the reads answered (or being answered): where a fault starts

        def _real(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def _wait(self) -> None:
            """A metadata request's round trip."""
            with self.lock:
                self.counts["meta_requests"] += 1
            if self.latency_s:
                time.sleep(self.latency_s)

        def init_with_config(self, conn, config) -> None:
            # The kernel keeps names and attributes this long (as NFS does between its revalidations, actimeo), so
            # a load's stat calls do not each cost a round trip; a file changed behind the mount is seen once they
            # expire, its pages kept before then dropped (the kernel's auto_inval_data, on the new mtime).
            config.entry_timeout = config.attr_timeout = config.negative_timeout = attr_timeout_s

        def getattr(self, path, fh=None):
            if path == CONTROL:
                return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
            if path.startswith(CONTROL + "/"):
                if path[len(CONTROL) + 1:] not in ("stats", "control"):
                    raise mfusepy.FuseOSError(errno.ENOENT)
                return {"st_mode": stat.S_IFREG | 0o644, "st_nlink": 1, "st_size": 0}
            self._wait()
            st = os.lstat(self._real(path))
            return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid")} | {
                "st_atime": st.st_atime_ns, "st_mtime": st.st_mtime_ns, "st_ctime": st.st_ctime_ns}  # use_ns

        def readdir(self, path, fh):
            self._wait()
            return [".", "..", *os.listdir(self._real(path))]

        def readlink(self, path):
            self._wait()
            return os.readlink(self._real(path))

        def statfs(self, path):
            st = os.statvfs(source)
            return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                                 "f_ffree", "f_namemax")}

        def open(self, path, fi):
            if path.startswith(CONTROL + "/"):
                fi.direct_io = 1  # read afresh every time, never from the page cache
                fi.fh = os.open("/dev/null", os.O_RDONLY)  # a unique handle to tell control files by
                with self.lock:  # the counts as they are at the open: one JSON object, however many reads take it
                    self.control_fhs[fi.fh] = json.dumps(dict(self.counts, config={
                        "mode": mode, "latency_s": self.latency_s, "bandwidth_bps": self.bucket.rate})).encode() \
                        if path == CONTROL + "/stats" else b""
                return 0
            if fi.flags & (os.O_WRONLY | os.O_RDWR):
                raise mfusepy.FuseOSError(errno.EROFS)
            self._wait()
            fi.fh = os.open(self._real(path), os.O_RDONLY)
            if mode == "direct":
                fi.direct_io = 1
            else:
                fi.keep_cache = 1  # an open does not drop the pages other opens read
            return 0

        def read(self, path, size, offset, fi):
            if fi.fh in self.control_fhs:
                return self.control_fhs[fi.fh][offset : offset + size]
            with self.lock:
                self.in_flight += 1
                self.counts["most_in_flight"] = max(self.counts["most_in_flight"], self.in_flight)
            try:
                if self.latency_s:
                    time.sleep(self.latency_s)
                size = self._faulty(size, max(0, min(size, os.fstat(fi.fh).st_size - offset)))
                data = os.pread(fi.fh, size, offset)
                self.bucket.take(len(data))
            finally:
                with self.lock:
                    self.in_flight -= 1
            with self.lock:
                c, f = self.counts, self.counts["files"].setdefault(path, {"requests": 0, "bytes": 0})
                c["requests"] += 1
                c["bytes"] += len(data)
                f["requests"] += 1
                f["bytes"] += len(data)
            return data

        def _faulty(self, size: int, nbytes: int) -> int:
            """Apply the fault set (once `after_bytes` were served): stall until answering again, fail with an
            errno, or serve half the bytes asked for (at least a page). `nbytes`: what this read, of `size` bytes,
            would serve; it counts as served as soon as it is let through, so that reads answered at once (all of a
            small file's, many in flight) cannot all pass before any is counted."""
            fault = self.fault
            with self.lock:
                before, self.answered = self.answered, self.answered + nbytes
            if not fault or before < fault.get("after_bytes", 0):
                return size
            if fault.get("stall"):
                answering = self.answering  # this read's stall: a `recover` answers the reads after it, not this one
                with self.lock:
                    if self.counts["stalled_at"] is None:
                        self.counts["stalled_at"] = time.monotonic()
                while not answering.wait(0.1):
                    if not mounted(mountpoint):  # aborted and unmounted: end the read, or the server never ends
                        raise mfusepy.FuseOSError(errno.EIO)
            if fault.get("fail"):
                raise mfusepy.FuseOSError(int(fault["fail"]))
            return max(4096, size // 2) if fault.get("short") and size > 4096 else size

        def truncate(self, path, length, fh=None):
            if not path.startswith(CONTROL + "/"):
                raise mfusepy.FuseOSError(errno.EROFS)

        def write(self, path, data, offset, fi):
            if path != CONTROL + "/control":
                raise mfusepy.FuseOSError(errno.EROFS)
            try:
                change = json.loads(data)
            except ValueError:
                raise mfusepy.FuseOSError(errno.EINVAL) from None
            if "latency_s" in change:
                self.latency_s = float(change["latency_s"])
            if "bandwidth_bps" in change:
                self.bucket = TokenBucket(float(change["bandwidth_bps"]))
            if change.get("reset"):
                self.reset()
            if change.get("recover"):  # a server back: new reads answered, those already stalled held
                self.held.append(self.answering)
                self.fault, self.answering = {}, threading.Event()
                self.answering.set()
            if change.get("release"):
                for stall in self.held:
                    stall.set()
                self.held.clear()
            if "fault" in change:
                self.fault = dict(change["fault"] or {})
                self.answering.clear() if self.fault.get("stall") else self.answering.set()
            return len(data)

        def release(self, path, fi):
            self.control_fhs.pop(fi.fh, None)
            os.close(fi.fh)

    mfusepy.FUSE(Passthrough(), mountpoint, raw_fi=True, foreground=True, fsname=f"netfs:{source}",
                 subtype="raylazy-netfs", auto_unmount=True, max_threads=max_threads, max_idle_threads=max_threads)


# --- the client side: mount, read the counts, unmount -----------------------------------------------------------

def _die_with_parent() -> None:
    """In the server before exec: SIGKILL it when the process that started it dies (Linux); `auto_unmount` then
    unmounts."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def mounted(path: str) -> bool:
    """Whether `path` is a mount point in this process's mount table."""
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4].replace("\\040", " ") == path for line in f)


def running(mountpoint: str) -> list:
    """Processes still running whose command line names `mountpoint`: libfuse's auto_unmount helper (fusermount3)
    unmounts after the server ends, then exits. Zombies have ended: the helper's parent, once the server is gone,
    is the machine's init, which reaps it when it will."""
    import psutil

    return [p for p in psutil.process_iter(["cmdline", "status"])
            if mountpoint in " ".join(p.info["cmdline"] or ()) and p.info["status"] != psutil.STATUS_ZOMBIE]


class NetFS:
    """`source` mounted at a new temporary directory by a server process of its own (see the module docstring)."""

    def __init__(self, source: str, mode: str = "cached", latency_s: float = 0.0, bandwidth_bps: float = 0.0,
                 read_ahead_kb: int | None = None, max_threads: int = 64, start_timeout_s: float = 15.0,
                 attr_timeout_s: float = 3600.0):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        problem = fuse_problem()
        if problem:
            raise RuntimeError(problem)
        self.source, self.mode = os.path.realpath(source), mode
        self.mountpoint = tempfile.mkdtemp(prefix="raylazy-netfs-")
        self.log_path = self.mountpoint + ".log"
        with open(self.log_path, "wb") as log:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), self.source, self.mountpoint, "--mode", mode,
                 "--latency-s", repr(latency_s), "--bandwidth-bps", repr(bandwidth_bps), "--max-threads",
                 str(max_threads), "--attr-timeout-s", repr(attr_timeout_s)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not mounted(self.mountpoint):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the FUSE server did not mount {self.mountpoint} (exit status "
                                       f"{self.proc.poll()}); its log:\n{self.log()[-3000:]}")
                time.sleep(0.05)
            if read_ahead_kb is not None:
                self.read_ahead(read_ahead_kb)
        except BaseException:
            self.close()
            raise

    def read_ahead(self, kb: int) -> None:
        """Set the mount's read-ahead (its bdi's read_ahead_kb; root only). The kernel reads a FUSE mount's pages
        in requests of at most its read-ahead, 128 KiB by default, where an NFS client asks for rsize (1 MiB) at a
        time for large reads: 1024 makes the cached mode's requests NFS-sized."""
        dev = os.stat(self.mountpoint).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", "w") as f:
            f.write(str(kb))

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def path(self, *names: str) -> str:
        return os.path.join(self.mountpoint, *names)

    def stats(self) -> dict:
        """The counts since the mount (or the last reset): `requests` and `bytes` of reads served, the same per file
        under `files` (by path in the mount, "/name"), `meta_requests` (lookups, opens, listings), `most_in_flight`
        (most reads served at once), `stalled_at` (the `time.monotonic()` of the first read a stall held, None before
        one: Linux's monotonic clock is the machine's, so another process may compare it), and the `config` in force."""
        with open(self.path(CONTROL.lstrip("/"), "stats"), "rb") as f:
            return json.loads(f.read())

    def served(self, suffix: str = ".safetensors") -> int:
        """Bytes of reads served so far (`stats`) of the files whose names end with `suffix`."""
        return sum(f["bytes"] for name, f in self.stats()["files"].items() if name.endswith(suffix))

    def control(self, **change) -> None:
        """Change `latency_s` or `bandwidth_bps` while mounted; `reset=True` zeroes the counts; `fault={...}` makes
        every read once `after_bytes` (default 0) were served stall until the fault is changed (`stall=True`),
        fail with an errno (`fail=5`: EIO) or serve half the bytes asked for (`short=True`); `fault=None` clears it
        (the stalled reads answered). `recover=True` clears the fault as a network server that comes back does: new
        reads are answered while the reads already stalled stay blocked (in the kernel, for their callers) until
        `release=True`; then they read the files as they are at that moment."""
        with open(self.path(CONTROL.lstrip("/"), "control"), "w") as f:
            f.write(json.dumps(change))

    def abort(self) -> None:
        """Abort the mount's FUSE connection (/sys/fs/fuse/connections/N/abort, N the mount's device number), as an
        operator does with a hung network mount: every request waiting on it, and every later one, fails with
        ENOTCONN. Needs the fusectl file system mounted there (`mount -t fusectl none /sys/fs/fuse/connections`,
        as root: .ci/run does)."""
        path = f"/sys/fs/fuse/connections/{os.minor(os.stat(self.mountpoint).st_dev)}/abort"
        if not os.path.exists(path):
            raise RuntimeError(f"no {path}: mount fusectl (mount -t fusectl none /sys/fs/fuse/connections, as root)")
        with open(path, "w") as f:
            f.write("1")

    def reset(self) -> None:
        self.control(reset=True)

    def close(self) -> None:
        """Unmount, end the server, remove the mount point and the log (idempotent). A mount still busy (a file
        open on it) is detached, and its server ended: the kernel then fails every read of the files still open
        (ENOTCONN), as when a network mount is aborted."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if mounted(self.mountpoint) and subprocess.run(["fusermount3", "-u", self.mountpoint],
                                                       capture_output=True).returncode:
            subprocess.run(["fusermount3", "-uz", self.mountpoint], capture_output=True)
            proc.terminate()  # a detached mount is served until its last file closes: end it now
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for _ in range(100):  # auto_unmount's helper may still hold the mount for a moment after the server ends
            if not mounted(self.mountpoint) and not running(self.mountpoint):
                break
            time.sleep(0.05)
        try:
            os.rmdir(self.mountpoint)
        except OSError:
            pass
        try:
            os.remove(self.log_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> NetFS:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NetFS({self.source!r} at {self.mountpoint!r}, {self.mode})"


def _main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Serve SOURCE at MOUNTPOINT as an emulated network file system.")
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("--mode", choices=MODES, default="cached")
    p.add_argument("--latency-s", type=float, default=0.0)
    p.add_argument("--bandwidth-bps", type=float, default=0.0)
    p.add_argument("--max-threads", type=int, default=64)
    p.add_argument("--attr-timeout-s", type=float, default=3600.0)
    a = p.parse_args(argv)
    _serve(a.source, a.mountpoint, a.mode, a.latency_s, a.bandwidth_bps, a.max_threads, a.attr_timeout_s)


if __name__ == "__main__":
    _main(sys.argv[1:])
