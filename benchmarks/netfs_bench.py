"""python -m benchmarks.netfs_bench: raylazy's rank readers against a naive loader and a raw read of the node's
bytes, on the emulated network file system (benchmarks/netfs.py), one node, cold.

Each run mounts the checkpoint afresh (a new mount has no cached page: cold) with the mode's profile, plans
through the mount, then starts one process per rank (forked after every import: pre-started) and times them
from the moment all are told to go until the last is done. Loaders:

- `raw`: the storage's limit for the node, each rank reading its 1/tp of the files laid end to end once, in
  four threads of 16 MiB preads (`benchmarks.loaders.impls.load_raw`);
- `naive`: safetensors' safe_open, get_tensor and narrow, every rank (`impls.load_naive`): a shared mmap, which
  an uncached (direct_io) mount refuses;
- `ranged`: `raylazy.io.ranged.read_rank_ranged`, each rank its own byte ranges;
- `cooperative`: `raylazy.io.cooperative.read_rank_cooperative`, the node's union once through the page cache
  (it maps the files: an uncached mount refuses it too);
- `raylazy`: what `raylazy.load` reads a node with (the node-read driver, `raylazy.io.nodes.node_reads`, on the
  reader options shaped for the mount's kind, `ReaderOptions.shaped`): the backend it picks for the storage
  (cooperative, through the page cache, or without one through stages in shared memory), as many requests in flight
  and as large as the kind's cost model says;
- `exchange`: the same, the node read by the exchange (gloo here; what GPU ranks read a mount without a page cache
  with, over NCCL).

Every (mode, loader) is run `--runs` times, the loaders' order rotating between runs, all modes and loaders
side by side in one alternating run. The table gives the median seconds, that time over raw's, and what
reached the mount: bytes (over the checkpoint's), requests, their mean size and the most in flight at once.

    python -m benchmarks.netfs_bench --tp 2,4 --size-gb 0.5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback

from .loaders import impls
from .loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint
from .netfs import MODE_PROFILES, PROFILES, fuse_problem

LOADERS = ("raw", "naive", "ranged", "cooperative", "exchange", "raylazy")
_FORK = multiprocessing.get_context("fork")


def _load(loader: str, torch, plan, rank: int, files: list[str], load_id: str, meet: str, read) -> None:
    from dataclasses import replace

    from raylazy.core.schedule import NodeRead
    from raylazy.io.backends import read_rank
    from raylazy.io.collective import meet_through
    from raylazy.io.cooperative import read_rank_cooperative
    from raylazy.io.ranged import read_rank_ranged

    rp = plan.ranks[rank]
    if loader in ("raw", "naive"):
        impls.LOADERS[loader](torch, rp, files)
    elif loader == "ranged":
        read_rank_ranged(rp, "cpu")
    elif loader == "cooperative":
        read_rank_cooperative(rp, "cpu", node_read=NodeRead(plan.node_of(rank), load_id=load_id))
    else:  # as raylazy.load reads (`read`: the node-read driver's), the exchange meeting through a file here
        node_read = read.node_read
        if read.reader.backend == "exchange":
            node_read = replace(node_read, address=meet_through(meet, rank, 60.0))
        read_rank(rp, "cpu", options=read.reader, node_read=node_read)


def _rank(loader, plan, rank, files, load_id, meet, read, go, done) -> None:
    import torch

    torch.set_num_threads(1)
    go.wait()
    t = time.perf_counter()
    try:
        _load(loader, torch, plan, rank, files, load_id, meet, read)
        done.put((rank, time.perf_counter() - t, None))
    except BaseException as e:  # noqa: BLE001  (reported in the table)
        done.put((rank, time.perf_counter() - t, f"{type(e).__name__}: {e}".splitlines()[0][:80]))
        traceback.print_exc()


def run_once(model_dir: str, mode: str, loader: str, tp: int) -> dict:
    """One cold load of every rank of `tp` by `loader` on a fresh mount of `model_dir` in `mode`."""
    import raylazy
    from raylazy.core.options import ReaderOptions
    from raylazy.core.schedule import with_node_schedules
    from raylazy.io.nodes import node_reads
    from raylazy.storage import storage_for

    with PROFILES[MODE_PROFILES[mode]].mount(model_dir) as fs, \
            tempfile.TemporaryDirectory(prefix="raylazy-netfs-meet-") as meeting:
        plan = raylazy.plan(fs.mountpoint, tp=tp)
        load_id = f"netfsbench{os.getpid()}x{time.monotonic_ns()}"
        shaped = ReaderOptions().shaped(storage_for(plan.root).cost_model(plan.root, plan.storage))
        reads = [None] * tp
        if loader in ("raylazy", "exchange"):
            reader = shaped.model_copy(update={"backend": "exchange"}) if loader == "exchange" else shaped
            plan, reads = node_reads(plan, ["node0"] * tp, ["cpu"] * tp, reader, load_id, lambda ranks: [""])
        else:
            plan = with_node_schedules(plan, ["node0"] * tp)
        files = checkpoint_files(fs.mountpoint)
        fs.reset()  # planning's header reads are not the load's
        go, done = _FORK.Event(), _FORK.Queue()
        meet = os.path.join(meeting, "address")  # where an exchange's local rank 0 names its address
        procs = [_FORK.Process(target=_rank, args=(loader, plan, r, files, load_id, meet, reads[r], go, done))
                 for r in range(tp)]
        for p in procs:
            p.start()
        time.sleep(0.5)  # every rank forked and waiting
        t = time.perf_counter()
        go.set()
        results = [done.get(timeout=600) for _ in range(tp)]
        seconds = time.perf_counter() - t
        for p in procs:
            p.join(30)
        stats = fs.stats()
    errors = [e for _, _, e in results if e]
    return dict(seconds=seconds, error=errors[0] if errors else None, bytes=stats["bytes"],
                requests=stats["requests"], in_flight=stats["most_in_flight"], checkpoint=plan.checkpoint_bytes,
                plan=plan)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.netfs_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="use this checkpoint instead of building one")
    ap.add_argument("--size-gb", type=float, default=0.5, help="checkpoint size to build (default 0.5)")
    ap.add_argument("--tp", default="2,4")
    ap.add_argument("--modes", default="cached,direct,fuse", help="of " + ", ".join(MODE_PROFILES))
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args(argv)
    problem = fuse_problem()
    if problem:
        sys.exit(problem)
    import torch  # noqa: F401  (imported before the ranks fork: pre-started)

    import raylazy.io.cooperative  # noqa: F401
    import raylazy.io.exchange  # noqa: F401
    import raylazy.io.ranged  # noqa: F401

    impls.preload("naive")
    model_dir = a.model_dir or ensure_checkpoint(ModelSpec(size_gb=a.size_gb, shard_size="200MB"),
                                                 os.path.join(tempfile.gettempdir(), "raylazy-netfs-bench"))
    loaders, modes, tps = a.loaders.split(","), a.modes.split(","), [int(x) for x in a.tp.split(",")]
    for mode in modes:
        p = PROFILES[MODE_PROFILES[mode]]
        print(f"{mode}: {p.note}: latency {p.latency_s * 1e3:g} ms, budget {p.bandwidth_bps / 1e6:g} MB/s, "
              f"read-ahead {p.read_ahead_kb or 128} KiB")
    run_once(model_dir, modes[0], loaders[0], tps[0])  # a first load warms this process and the machine, untimed
    results: dict[tuple, list[dict]] = {}
    for run in range(a.runs):
        for tp in tps:
            for mode in modes:
                order = loaders[run % len(loaders):] + loaders[: run % len(loaders)]
                for loader in order:
                    r = run_once(model_dir, mode, loader, tp)
                    results.setdefault((tp, mode, loader), []).append(r)
                    print(f"run {run} tp={tp} {mode} {loader}: {r['seconds']:.2f} s {r['error'] or ''}", flush=True)
    print()
    print(f"{'tp':>2} {'mode':7} {'loader':12} {'seconds':>8} {'x raw':>6} {'served':>7} {'requests':>8} "
          f"{'KiB/req':>7} {'in flight':>9}")
    for tp in tps:
        for mode in modes:
            raw = results.get((tp, mode, "raw"))
            raw_s = statistics.median(r["seconds"] for r in raw) if raw else 0.0
            for loader in loaders:
                rs = results[(tp, mode, loader)]
                if any(r["error"] for r in rs):
                    print(f"{tp:>2} {mode:7} {loader:12} failed: {next(r['error'] for r in rs if r['error'])}")
                    continue
                s = statistics.median(r["seconds"] for r in rs)
                req = statistics.median(r["requests"] for r in rs)
                served = statistics.median(r["bytes"] for r in rs)
                print(f"{tp:>2} {mode:7} {loader:12} {s:8.2f} {s / raw_s if raw_s else 0:6.2f} "
                      f"{served / rs[0]['checkpoint']:6.2f}x {req:8.0f} {served / max(req, 1) / 1024:7.0f} "
                      f"{max(r['in_flight'] for r in rs):9}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
