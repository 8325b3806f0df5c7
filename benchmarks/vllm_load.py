"""vLLM load formats compared: seconds from `LLM(...)` to ready and bytes pulled from storage, cold.

Run with the vLLM virtualenv's python (docs/vllm.md), from the repository root, e.g.

    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/vllm_load.py --tp 1 2 \
        --formats raylazy auto fastsafetensors runai_streamer

Each run is a fresh process (`--one`), so no run starts with another's imports or engine. Before it, the
parent evicts the checkpoint's pages (posix_fadvise DONTNEED: a cold start) and reads the device's counters
(/proc/diskstats: what the whole machine pulled from the checkpoint's device, other processes included). The
child imports vLLM, times `LLM(...)` (engine, workers, weights, KV cache: until it can serve), and sums the
`read_bytes` of itself and its descendants, the vLLM workers (/proc/PID/io: what these processes made the
device read; "worker max" is the most one worker read: ranks share the page cache, so a page another rank
already pulled costs nothing) before shutting down. The engine runs in the child's process (VLLM_ENABLE_V1_MULTIPROCESSING=0);
at tp > 1 the workers are its children. "load s" is the weights' own time as the loader logs it (vLLM's
default loader: "Loading weights took"; raylazy: the rank's line, slowest rank), when it logs one. A format
that fails is reported with the end of its error. The default checkpoint is the benchmark's 0.53 GB Llama
(benchmarks/loaders/checkpoint.py, 3 layers, head_dim 64), built on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint  # noqa: E402
from benchmarks.loaders.diskstats import Device  # noqa: E402
from benchmarks.loaders.impls import proc_io  # noqa: E402
from benchmarks.loaders.pagecache import evict  # noqa: E402

FORMATS = ("raylazy", "auto", "fastsafetensors", "runai_streamer")
#: The benchmark checkpoint: Llama-shaped, bf16, 3 layers (0.53 GB).
SPEC = ModelSpec(layers=3)


def _read_bytes(pid: int) -> int:
    return proc_io(pid)["read_bytes"]


def one(model: str, load_format: str, tp: int) -> dict:
    """In the child: time LLM(...) and the bytes this process and the workers read."""
    import psutil
    from vllm import LLM

    before = _read_bytes(os.getpid())
    t0 = time.perf_counter()
    llm = LLM(model=model, load_format=load_format, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=256, max_num_seqs=1)
    ready = time.perf_counter() - t0
    workers = [_read_bytes(p.pid) for p in psutil.Process().children(recursive=True)]
    own = _read_bytes(os.getpid()) - before
    llm.llm_engine.engine_core.shutdown()
    # tp=1: the worker is this process; tp > 1: the workers are its children
    return {"ready_s": ready, "read_bytes": own + sum(workers), "worker_max": max(workers) if tp > 1 else own}


def measure(model: str, load_format: str, tp: int, device: Device) -> dict:
    files = checkpoint_files(model)
    left = evict(files)
    disk0 = device.settled_reads() if device.name else None
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", load_format, "--tp", str(tp),
                           "--model", model], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    disk = (device.settled_reads() - disk0).bytes if disk0 else None
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if done.returncode or result is None:
        error = [line for line in done.stdout.splitlines() if "Error" in line] or done.stdout.splitlines()
        return {"format": load_format, "tp": tp, "error": (error[-1] if error else "")[-200:]}
    load = [float(x) for x in re.findall(r"Loading weights took ([\d.]+) seconds", done.stdout)]
    load += [float(x) for x in re.findall(r"raylazy: rank .* ([\d.]+) s in all", done.stdout)]
    ratios = [float(x) for x in re.findall(r"raylazy: rank \d+ read .*? needed \(([\d.]+)x", done.stdout)]
    return {"format": load_format, "tp": tp, **result, "disk_bytes": disk, "load_s": max(load, default=None),
            "read_over_needed": max(ratios, default=None), "resident_before": left}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint directory (default: the benchmark's Llama, built on first use)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    ap.add_argument("--one", metavar="FORMAT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model = args.model or ensure_checkpoint(SPEC)
    if args.one:
        print("RESULT " + json.dumps(one(model, args.one, args.tp[0])), flush=True)
        return 0
    device = Device(checkpoint_files(model))
    print(f"checkpoint {model}: {sum(os.path.getsize(f) for f in checkpoint_files(model)) / 1e9:.2f} GB; device "
          f"{device.name or device.missing}")
    print(f"{'format':<16} {'tp':>2} {'ready s':>8} {'load s':>7} {'processes read':>15} {'worker max':>11} "
          f"{'device read':>12} {'read/needed':>11}")
    for tp in args.tp:
        for fmt in args.formats:
            r = measure(model, fmt, tp, device)
            print(json.dumps(r), file=sys.stderr, flush=True)
            if "error" in r:
                print(f"{fmt:<16} {tp:>2} failed: {r['error']}", flush=True)
                continue
            gb = lambda n: "-" if n is None else f"{n / 1e9:.3f} GB"  # noqa: E731
            load = "-" if r["load_s"] is None else f"{r['load_s']:.2f}"
            ratio = "-" if r["read_over_needed"] is None else f"{r['read_over_needed']:.3f}"
            print(f"{fmt:<16} {tp:>2} {r['ready_s']:>8.1f} {load:>7} {gb(r['read_bytes']):>15} "
                  f"{gb(r['worker_max']):>11} {gb(r['disk_bytes']):>12} {ratio:>11}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
