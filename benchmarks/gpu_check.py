"""The GPU check, in one command with a time limit: the GPU-marked tests, then a GPU benchmark.

    python -m benchmarks.gpu_check [--time-limit 540] [--size-gb 4 | --model DIR] [--out gpu-check]

Ranks are the visible GPUs (one process each, rank i on cuda:i, all on one node). The benchmark loads a
generated Llama-shaped checkpoint of about `--size-gb` GB (built once, cached as `python -m benchmarks.loaders`
caches its own) at tp = number of GPUs with:

- raw: each rank reads its 1/tp of the checkpoint's files into host memory (no shards): the storage bound;
- ranged: raylazy's per-rank reader onto the rank's GPU (pinned staging, its own ranges only);
- fastsafetensors: raylazy's fastsafetensors backend onto the rank's GPU (nogds when several ranks);
- exchange: cooperative reads, stripe -> pinned buffer -> the reader's GPU -> NCCL to the keepers
  (`raylazy.io.exchange`; the NCCL setup is inside the time).

Each is run cold (the files' pages evicted with POSIX_FADV_DONTNEED first) unless --warm. Time is the slowest
rank's, from a barrier all ranks pass; GB/s is the checkpoint's bytes over that time. It prints a table and
writes `gpu_check.json` to --out. Without a CUDA GPU (or without NCCL) it exits 2 at once, saying so; a step
that runs past the time limit is stopped and reported, and the exit status is 1 if anything failed.
`--cpu RANKS` runs the benchmark part on CPU ranks (the exchange over gloo) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOADERS = ("raw", "ranged", "fastsafetensors", "exchange")
GPU_TESTS = ("tests/io/test_exchange.py", "tests/cluster/test_load.py")


def gpus_or_exit() -> int:
    """The number of visible CUDA GPUs; exits 2 with the reason when there are none or NCCL is missing."""
    import torch
    import torch.distributed as dist

    why = ""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        why = (f"no CUDA GPU is visible (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}): "
               "this check needs at least one GPU")
    elif not dist.is_nccl_available():
        why = f"torch {torch.__version__} has no NCCL: install a CUDA build of torch"
    if why:
        print(f"gpu_check: {why}; nothing was run", file=sys.stderr)
        sys.exit(2)
    return torch.cuda.device_count()


def run_tests(seconds: float) -> dict:
    """pytest -m gpu over the GPU tests, stopped after `seconds`."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TESTS]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, timeout=max(1.0, seconds), capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        return {"ok": False, "status": f"timed out after {seconds:.0f} s",
                "tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    tail = (done.stdout + done.stderr)[-2000:]
    return {"ok": done.returncode == 0, "status": f"exit {done.returncode} in {time.monotonic() - t0:.1f} s",
            "tail": tail}


def _rank(loader: str, rank: int, tp: int, model_dir: str, meet: str, cpu: bool, barrier, results) -> None:
    """One rank of one loader: plan, wait for the others, load onto cuda:rank (or the CPU), report the seconds."""
    import torch

    import raylazy
    from benchmarks.loaders.checkpoint import checkpoint_files
    from benchmarks.loaders.impls import load_raw
    from raylazy.core.options import ReaderOptions
    from raylazy.core.schedule import node_schedule
    from raylazy.io.collective import meet_through
    from raylazy.io.exchange import read_rank_exchanged
    from raylazy.io.fst import read_rank_fastsafetensors
    from raylazy.io.nodes import node_read
    from raylazy.io.ranged import read_rank_ranged

    try:
        device = "cpu" if cpu else f"cuda:{rank}"
        if not cpu:
            torch.cuda.set_device(rank)
            torch.empty(1, device=device)  # CUDA context before the clock starts, as a rank actor has
        plan = raylazy.plan(model_dir, tp)
        rp = plan.ranks[rank]
        address = meet_through(meet, rank, 120.0) if loader == "exchange" else ""
        barrier.wait()
        t0 = time.perf_counter()
        if loader == "raw":
            load_raw(torch, rp, checkpoint_files(model_dir))
        elif loader == "ranged":
            read_rank_ranged(rp, device)
        elif loader == "fastsafetensors":
            read_rank_fastsafetensors(rp, device, options=ReaderOptions(backend="fastsafetensors", nogds=tp > 1 or None))
        else:
            task = node_read("exchange", plan, node_schedule(plan, range(tp), "node"), "", address)
            read_rank_exchanged(rp, device, node_read=task)
        if not cpu:
            torch.cuda.synchronize(device)
        results.put((rank, time.perf_counter() - t0, ""))
    except BaseException as e:  # noqa: BLE001  (reported in the table)
        results.put((rank, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def bench(loader: str, tp: int, model_dir: str, seconds: float, cpu: bool = False) -> dict:
    """Run `loader` on tp rank processes; the slowest rank's seconds, or why it failed."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(tp), ctx.Queue()
    meet = os.path.join(tempfile.mkdtemp(prefix="raylazy-meet-"), "address")
    procs = [ctx.Process(target=_rank, args=(loader, r, tp, model_dir, meet, cpu, barrier, results), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + seconds
    got = {}
    while len(got) < tp and time.monotonic() < deadline:
        try:
            rank, secs, err = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            got[rank] = (secs, err)
        except Exception:  # noqa: BLE001  (queue.Empty: keep waiting until the deadline)
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    shutil.rmtree(os.path.dirname(meet), ignore_errors=True)
    errors = sorted({e for _, e in got.values() if e})
    if len(got) < tp:
        errors.append(f"{tp - len(got)} rank(s) gave no result within {seconds:.0f} s")
    return {"seconds": None if errors else max(s for s, _ in got.values()), "error": "; ".join(errors)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds for everything (default 540)")
    ap.add_argument("--size-gb", type=float, default=4.0, help="generated checkpoint's size in GB (default 4)")
    ap.add_argument("--model", help="load this checkpoint directory instead of a generated one")
    ap.add_argument("--cpu", type=int, metavar="RANKS",
                    help="check this script without a GPU: the benchmark only, on RANKS CPU ranks (gloo)")
    ap.add_argument("--out", default="gpu-check", help="directory for gpu_check.json")
    ap.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated, of {', '.join(LOADERS)}")
    ap.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    ap.add_argument("--warm", action="store_true", help="do not evict the checkpoint's pages before each loader")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.time_limit
    tp = args.cpu or gpus_or_exit()
    import torch

    from benchmarks.loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint
    from benchmarks.loaders.pagecache import evict

    report: dict = {"gpus": [] if args.cpu else [torch.cuda.get_device_name(i) for i in range(tp)], "tp": tp,
                    "torch": torch.__version__}
    ok = True
    if not (args.skip_tests or args.cpu):
        report["tests"] = run_tests(min(deadline - time.monotonic(), args.time_limit / 2))
        ok &= report["tests"]["ok"]
        print(f"GPU tests: {'passed' if report['tests']['ok'] else 'FAILED'} ({report['tests']['status']})")
        if not report["tests"]["ok"]:
            print(report["tests"]["tail"])
    model_dir = args.model or ensure_checkpoint(ModelSpec(size_gb=args.size_gb))
    files = checkpoint_files(model_dir)
    total = sum(os.path.getsize(f) for f in files)
    report.update(model_dir=model_dir, checkpoint_bytes=total, cache="warm" if args.warm else "cold", runs={})
    print(f"\n{'loader':16s} {'seconds':>8s} {'GB/s':>7s} {'x raw':>7s}   (tp={tp}, {total / 1e9:.2f} GB, {report['cache']})")
    for loader in args.loaders.split(","):
        left = deadline - time.monotonic()
        if left < 5:
            report["runs"][loader] = {"seconds": None, "error": "not run: time limit reached"}
        else:
            if not args.warm:
                evict(files)
            report["runs"][loader] = bench(loader, tp, model_dir, left, cpu=bool(args.cpu))
        run = report["runs"][loader]
        raw = report["runs"].get("raw", {}).get("seconds")
        if run["seconds"]:
            run["gbps"] = total / run["seconds"] / 1e9
            ratio = f"{run['seconds'] / raw:7.2f}" if raw else f"{'':7s}"
            print(f"{loader:16s} {run['seconds']:8.2f} {run['gbps']:7.2f} {ratio}")
        else:
            ok = False
            print(f"{loader:16s} {'-':>8s} {'-':>7s} {'':7s}   {run['error']}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"\nwrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
