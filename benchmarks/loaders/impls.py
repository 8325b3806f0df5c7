"""What one rank does under each loader, plus the measurements taken around it.

Every loader returns the rank's shards as {name: tensor} exactly as raylazy's plan
defines them (`cut` applies a TensorShard's dim and pieces to a full tensor), so
all loaders can be checked against the same reference checksums. raylazy itself
runs through `raylazy.load` (see runner.py); `raylazy_direct` here is only for the
smoke test of the helpers.

Every loader ends with the shards in the rank's own memory. safetensors >= 0.6
returns `get_tensor` and `get_slice(...)[...]` as views of a private mmap of the
file (nothing is read until touched), so naive and lazy copy their shards out
(`clone`), which is what moving them to a GPU would do.
"""

from __future__ import annotations

import hashlib
import os
import resource
import time
from dataclasses import asdict, dataclass

from raylazy.io.stats import proc_io


@dataclass(frozen=True)
class RayLoader:
    """A raylazy row: one `raylazy.load(dir, tp, device="cpu", **options)` per run, fresh actors each time.

    `reader`: which of the command's reader settings (threads, chunk_bytes, max_gap) it takes; `alone`: the
    options instead when each rank runs alone on its node (rank-per-node), if they differ.
    """

    options: dict
    reader: tuple[str, ...] = ("max_gap",)
    alone: dict | None = None


#: Loaders that run in benchmark-owned rank processes (worker.py), started once per tp, all of a run's ranks
#: told to start at once; the raylazy ones run in the Ray actors `raylazy.load` starts.
PROCESS_LOADERS = ("naive", "lazy", "fastsafetensors", "runai", "raw")
RAY_LOADERS = {
    "raylazy-ranged": RayLoader({"backend": "ranged"}, ("threads", "chunk_bytes", "max_gap")),
    "raylazy-fst": RayLoader({"backend": "fastsafetensors", "nogds": True}),
    # the default ("auto"): ranks sharing a node read cooperatively; a rank alone on its node reads ranged
    "raylazy-coop": RayLoader({"backend": "cooperative"}, alone={"backend": "ranged"}),
    # cooperative with 4 stripe reader threads per rank filling the page cache ahead of the copies
    "raylazy-coop-readers": RayLoader({"backend": "cooperative", "stripe_readers": 4}, alone={"backend": "ranged"}),
}
ALL_LOADERS = PROCESS_LOADERS[:4] + tuple(RAY_LOADERS) + ("raw",)

RAW_CHUNK = 16 << 20


def cut(torch, full, shard, owned: bool):
    """`shard` of the full tensor: narrow along shard.dim for each piece (a fresh tensor unless `owned` and whole)."""
    if shard.dim is None:
        return full if owned else full.clone()
    dim = shard.dim % full.dim()
    if len(shard.pieces) == 1 and tuple(shard.shape) == (
        tuple(full.shape[:dim]) + (shard.pieces[0][2],) + tuple(full.shape[dim + 1:])
    ):
        src, _, length = shard.pieces[0]
        return full.narrow(dim, src, length).clone()  # contiguous copy; the full tensor can go
    out = torch.zeros(tuple(shard.shape), dtype=full.dtype)
    for src, dst, length in shard.pieces:
        out.narrow(dim, dst, length).copy_(full.narrow(dim, src, length))
    return out


def _by_name(rank_plan) -> dict:
    return {t.name: t for t in rank_plan.tensors}


def load_naive(torch, rank_plan, files: list[str]) -> dict:
    """Open every file with safe_open, get_tensor every tensor of this rank, narrow (clone) it."""
    from safetensors import safe_open

    want, out = _by_name(rank_plan), {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in want:
                    full = f.get_tensor(name)  # safetensors >= 0.6: a view of a private mmap, no copy yet
                    out[name] = cut(torch, full, want[name], owned=False)
                    del full
    return out


def load_lazy(torch, rank_plan, files: list[str]) -> dict:
    """safe_open(...).get_slice(name)[...] for the rank's slice only."""
    from safetensors import safe_open

    want, out = _by_name(rank_plan), {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shard = want.get(name)
                if shard is None:
                    continue
                sl = f.get_slice(name)
                ndim = len(sl.get_shape())
                if shard.dim is None:
                    out[name] = (sl[tuple(slice(None) for _ in range(ndim))] if ndim else f.get_tensor(name)).clone()
                    continue
                dim = shard.dim % ndim
                pieces = []
                for src, dst, length in shard.pieces:
                    idx = tuple(slice(src, src + length) if d == dim else slice(None) for d in range(ndim))
                    pieces.append((dst, length, sl[idx]))
                if len(pieces) == 1 and tuple(pieces[0][2].shape) == tuple(shard.shape):
                    out[name] = pieces[0][2].clone()  # the slice is a view of safetensors' mmap: copy it in
                else:
                    t = torch.zeros(tuple(shard.shape), dtype=pieces[0][2].dtype if pieces else torch.uint8)
                    for dst, length, p in pieces:
                        t.narrow(dim, dst, length).copy_(p)
                    out[name] = t
    return out


def load_fastsafetensors(torch, rank_plan, files: list[str]) -> dict:
    """fastsafetensors' ParallelLoader over all files (CPU, nogds), narrow each tensor."""
    from fastsafetensors import ParallelLoader

    want, out = _by_name(rank_plan), {}
    loader = ParallelLoader(None, files, device="cpu", nogds=True, use_tqdm_on_load=False)
    try:
        for name, full in loader.iterate_weights():
            if name in want:
                out[name] = cut(torch, full, want[name], owned=True)  # yielded tensors own their memory
            del full
    finally:
        loader.close()
    return out


def load_runai(torch, rank_plan, files: list[str], distributed: bool = False) -> dict:
    """Run:ai model streamer's SafetensorsStreamer over all files (CPU), narrow each tensor; `distributed`: its
    distributed mode over the initialized torch.distributed group (each process reads a part, then broadcasts)."""
    from runai_model_streamer import SafetensorsStreamer

    want, out = _by_name(rank_plan), {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cpu", is_distributed=distributed)
        for name, full in streamer.get_tensors():
            if name in want:
                out[name] = cut(torch, full, want[name], owned=True)
            del full
    return out


def raw_share(files: list[str], tp: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank's contiguous 1/tp of the files' bytes laid end to end: [(path, start, end)]."""
    sizes = [os.path.getsize(p) for p in files]
    total = sum(sizes)
    lo, hi = total * rank // tp, total * (rank + 1) // tp
    out, base = [], 0
    for p, s in zip(files, sizes):
        a, b = max(lo, base), min(hi, base + s)
        if b > a:
            out.append((p, a - base, b - base))
        base += s
    return out


def load_raw(torch, rank_plan, files: list[str], threads: int = 4) -> dict:
    """This rank's 1/tp of the checkpoint, split in `threads` contiguous parts read at once with 16 MiB
    preads into reused buffers (the kernel's default read-ahead; no shards are built).

    The fastest page-cache read of these bytes measured on the benchmark machine: one sequential
    reader (1.1-1.3 GB/s) or POSIX_FADV_SEQUENTIAL (0.5 GB/s, much more CPU) were slower than four
    (1.5-1.8 GB/s).
    """
    from concurrent.futures import ThreadPoolExecutor

    parts = []
    for path, start, end in raw_share(files, rank_plan.tp, rank_plan.rank):
        step = -(-(end - start) // threads)
        parts += [(path, a, min(end, a + step)) for a in range(start, end, step)]

    def read(part):
        path, start, end = part
        view = memoryview(bytearray(min(RAW_CHUNK, end - start)))
        fd = os.open(path, os.O_RDONLY)
        try:
            off = start
            while off < end:
                n = os.preadv(fd, [view[: min(RAW_CHUNK, end - off)]], off)
                if n == 0:
                    raise EOFError(path)
                off += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, parts))
    return {}


def load_raylazy_direct(torch, rank_plan, files: list[str], backend: str = "ranged") -> dict:
    """raylazy's rank reader called in this process (no Ray): used by the smoke test only."""
    from raylazy.core.options import ReaderOptions

    if backend == "ranged":
        from raylazy.io.ranged import read_rank_ranged

        return read_rank_ranged(rank_plan, "cpu", options=ReaderOptions())[0]
    from raylazy.io.fst import read_rank_fastsafetensors

    return read_rank_fastsafetensors(rank_plan, "cpu", options=ReaderOptions(backend="fastsafetensors",
                                                                               nogds=True))[0]


LOADERS = {
    "naive": load_naive,
    "lazy": load_lazy,
    "fastsafetensors": load_fastsafetensors,
    "runai": load_runai,
    "raw": load_raw,
}


def preload(loader: str) -> None:
    """Import what the loader needs before timing starts."""
    import torch  # noqa: F401

    if loader in ("naive", "lazy"):
        import safetensors.torch  # noqa: F401
    elif loader == "fastsafetensors":
        import fastsafetensors  # noqa: F401
    elif loader == "runai":
        import runai_model_streamer  # noqa: F401


# --- measurements -------------------------------------------------------------------------------


def proc_status(pid: str | int = "self", keys=("VmRSS", "VmHWM", "RssAnon")) -> dict[str, int]:
    """Fields of /proc/PID/status in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def snapshot() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    io = proc_io()
    st = proc_status()
    return {"t": time.clock_gettime(time.CLOCK_MONOTONIC), "cpu": ru.ru_utime + ru.ru_stime,
            "rchar": io["rchar"], "read_bytes": io["read_bytes"], "anon": st.get("RssAnon", 0),
            "rss": st.get("VmRSS", 0)}


def reset_peak_rss(pid: str | int = "self") -> bool:
    """Reset VmHWM (peak RSS) of a process to its current RSS; False if the kernel refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def measured(fn, disk=None) -> tuple[object, dict]:
    """fn() with the rank's wall/CPU time, storage bytes and exact peak RSS around it.

    `disk` (diskstats.Device or None): its read counters when the rank starts ("disk_start"); the driver
    subtracts the earliest rank's from the counters once the run is over (runner.node_reads).
    """
    reset = reset_peak_rss()
    disk_start = disk.reads() if disk else None
    before = snapshot()
    result = fn()
    after = snapshot()
    peak = proc_status(keys=("VmHWM",)).get("VmHWM", 0) if reset else 0
    return result, {
        "pid": os.getpid(),
        "t_start": before["t"],
        "t_end": after["t"],
        "wall_s": after["t"] - before["t"],
        "cpu_s": after["cpu"] - before["cpu"],
        "rchar": after["rchar"] - before["rchar"],
        "read_bytes": after["read_bytes"] - before["read_bytes"],
        "anon_before": before["anon"],
        "rss_before": before["rss"],
        "peak_rss": peak,
        "disk_start": asdict(disk_start) if disk_start else None,
    }


def malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def checksums(shards: dict) -> dict[str, str]:
    """sha1 of each shard's bytes (with dtype and shape), for bit-identity checks across loaders."""
    import torch

    out = {}
    for name, t in shards.items():
        t = t.contiguous()
        h = hashlib.sha1(f"{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        out[name] = h.hexdigest()
    return out


def shard_bytes(shards: dict) -> int:
    return sum(t.numel() * t.element_size() for t in shards.values())
