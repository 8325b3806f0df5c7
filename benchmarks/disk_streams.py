"""Whether this machine's disk serves one stream best: a checkpoint file read cold by one stream and by several,
with positional reads and with copies out of a mapping (the vLLM format's path on a local disk, where raylazy
converts each tensor's dtype while copying it out of the file's mapping).

    python benchmarks/disk_streams.py --runs 9 [--file F.safetensors]

First the storage kind raylazy sees for the file (`one stream` where sysfs shows its disk rotational with one
hardware queue). Then each case, its pages evicted before it, in turn and in reverse order every other repetition:
medians and ranges. Positional reads: THREADS threads, each reading the next REQUEST bytes into a buffer of its
own. Copies: every tensor copied into fresh memory of the other float dtype (float32 <-> bf16), its pages brought
in by the copies' own page faults (the default loader's way) or ahead of them by `populating`'s threads (1 or 4,
chunks of 16 MiB as raylazy's readers make them, or 2 MiB).
The default file is benchmarks/vllm_load.py's small checkpoint stored in float32.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.loaders.pagecache import evict  # noqa: E402
from raylazy.core.dtypes import torch_dtype  # noqa: E402
from raylazy.io.cooperative import populating  # noqa: E402
from raylazy.storage import open_checkpoint  # noqa: E402
from raylazy.storage.kinds import storage_kind  # noqa: E402


def positional(path: str, size: int, threads: int, request: int) -> None:
    fd, nxt, lock = os.open(path, os.O_RDONLY), [0], threading.Lock()

    def reader() -> None:
        buf = bytearray(request)
        while True:
            with lock:
                at = nxt[0]
                nxt[0] += request
            if at >= size:
                return
            os.preadv(fd, [buf], at)

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    os.close(fd)


def copies(path: str, tensors, threads: int, chunk: int) -> None:
    """Each tensor copied out of a mapping of the file into fresh memory of the other float dtype."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    file = torch.frombuffer(mm, dtype=torch.uint8)
    start = min(t.start for t in tensors)
    with populating([(file, start, file.numel())], threads, chunk) if threads else nullcontext() as reached:
        for t in tensors:
            if reached:
                reached(file.data_ptr() + t.start)
            src = file[t.start : t.end].view(torch_dtype(t.dtype)).view(t.shape)
            torch.empty(t.shape, dtype=torch.bfloat16 if src.dtype == torch.float32 else torch.float32).copy_(src)
    del file, src
    mm.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", help="a .safetensors file (default: the small float32 benchmark checkpoint's)")
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args(argv)
    if args.file is None:
        from dataclasses import replace

        from benchmarks.loaders.checkpoint import ensure_checkpoint
        from benchmarks.vllm_load import SHAPES

        root = ensure_checkpoint(replace(SHAPES["small"], dtype="float32"))
        args.file = os.path.join(root, sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))[0])
    ckpt = open_checkpoint(os.path.dirname(os.path.abspath(args.file)))
    file = next(f for f in ckpt.files if os.path.samefile(f.path, args.file))
    tensors = sorted((t for t in file.tensors if t.dtype in ("F32", "BF16")), key=lambda t: t.start)
    size = os.path.getsize(args.file)
    cases = {f"read, {n} stream{'s' * (n > 1)} of {r >> 20 or r >> 10}{' MiB' if r >> 20 else ' KiB'}":
             (lambda n=n, r=r: positional(args.file, size, n, r))
             for n, r in ((1, 128 << 10), (1, 2 << 20), (1, 16 << 20), (4, 1 << 20), (4, 16 << 20))}
    cases |= {f"copies, {label}": (lambda n=n, c=c: copies(args.file, tensors, n, c << 20))
              for n, c, label in ((0, 16, "page faults"), (1, 16, "1 populate thread of 16 MiB chunks"),
                                  (4, 16, "4 populate threads of 16 MiB chunks"),
                                  (4, 2, "4 populate threads of 2 MiB chunks"))}
    print(f"{args.file}: {size / 1e9:.2f} GB, {len(tensors)} tensors; torch threads {torch.get_num_threads()}")
    print(f"storage: {storage_kind(args.file).describe()}")
    times = {name: [] for name in cases}
    for run in range(args.runs):
        for name in (list(cases) if run % 2 == 0 else list(cases)[::-1]):
            evict([args.file])
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    print("| case | s | GB/s |\n| --- | --- | --- |")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.3f} ({min(ts):.3f}-{max(ts):.3f}) | {size / m / 1e9:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
