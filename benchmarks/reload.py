"""Reloading checkpoints into long-lived ranks: `LoadedModel.reload` against its own reading, a fresh
`raylazy.load`, and naive safe_open + narrow in workers started beforehand.

    python -m benchmarks.reload                    # tp 4, three ~2 GB checkpoints (seeds 0-2), cold
    python -m benchmarks.reload --tp 2 --size-gb 0.5 --json reload.json

Three checkpoints of one layout (the loaders benchmark's Llama shape, seeds 0, 1 and 2; built once into
the benchmark cache). In one process with its own local Ray (`--tp` logical CPUs), every step cold
(each checkpoint's pages evicted with posix_fadvise DONTNEED, after waiting for the machine to quieten):

1. `raylazy.load(seed 0)`: fresh actors (placement group, actor start, torch import, plan, read);
2. `--reloads` reloads, seeds 1, 2, 0, ...: the same actors and shard tensors (`loaded.reload`);
3. naive with pre-started workers: `tp` Ray actors that imported torch and safetensors before the
   clock starts; per checkpoint the driver plans (for the slices) and each worker drops its old shards,
   then `safe_open` + `get_tensor` + narrow (copied out) of every tensor of its rank.

Per step: end to end (driver), reading (the slowest rank's own reading seconds), their ratio, and the
ranks' memory: anonymous RSS after the step summed over ranks (the shards) and the highest peak RSS
(VmHWM, reset before each reload and naive step; it counts mapped file pages too) of a rank during the step.
"""

from __future__ import annotations

import argparse
import json
import time

from .loaders.__main__ import gate
from .loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint
from .loaders.impls import load_naive, proc_status, reset_peak_rss
from .loaders.pagecache import evict


class NaiveWorker:
    """A pre-started worker: torch and safetensors imported at start; `load` replaces its shards naively."""

    def __init__(self):
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401

        self.shards = None

    def load(self, rank_plan, files: list[str]) -> dict:
        import torch

        self.shards = None
        reset_peak_rss()
        t0 = time.perf_counter()
        self.shards = load_naive(torch, rank_plan, files)
        return {"seconds": time.perf_counter() - t0, **proc_status()}


def _memory(pids: list[int]) -> dict:
    status = [proc_status(p) for p in pids]
    return {"RssAnon": sum(s["RssAnon"] for s in status), "VmHWM": max(s["VmHWM"] for s in status)}


def _cold(model_dir: str) -> None:
    gate(0.3, 30.0)
    left = evict(checkpoint_files(model_dir))
    if left:
        print(f"warning: {left} bytes of {model_dir} stayed in the page cache")


def run(tp: int, dirs: list[str], reloads: int) -> list[dict]:
    import ray

    import raylazy
    from benchmarks.reload import NaiveWorker as naive  # by reference: not __main__'s copy

    ray.init(address="local", num_cpus=tp, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    sequence = [dirs[(i + 1) % len(dirs)] for i in range(reloads)]
    rows = []

    def row(what: str, model_dir: str, e2e: float, reading: float, memory: dict) -> None:
        rows.append({"step": what, "seed": dirs.index(model_dir), "e2e_s": e2e, "reading_s": reading, **memory})
        print(json.dumps(rows[-1]), flush=True)

    _cold(dirs[0])
    t = time.perf_counter()
    loaded = raylazy.load(dirs[0], tp, device="cpu", use_gpu=False, progress=False)
    e2e = time.perf_counter() - t
    pids = [i.pid for i in loaded.ranks]
    row("raylazy.load (fresh actors)", dirs[0], e2e, max(s.seconds for s in loaded.stats), _memory(pids))
    for i, model_dir in enumerate(sequence):
        _cold(model_dir)
        for p in pids:
            reset_peak_rss(p)
        t = time.perf_counter()
        loaded.reload(model_dir)
        e2e = time.perf_counter() - t
        assert [r.pid for r in loaded.ranks] == pids
        row(f"reload {i + 1}", model_dir, e2e, max(s.seconds for s in loaded.stats), _memory(pids))
    loaded.release()

    worker = ray.remote(num_cpus=1)(naive)
    workers = [worker.remote() for _ in range(tp)]
    ray.get([w.__ray_ready__.remote() for w in workers])
    for i, model_dir in enumerate(sequence):
        _cold(model_dir)
        t = time.perf_counter()
        plan = raylazy.plan(model_dir, tp)
        files = checkpoint_files(model_dir)
        done = ray.get([w.load.remote(plan.ranks[r], files) for r, w in enumerate(workers)])
        e2e = time.perf_counter() - t
        row(f"naive, pre-started workers {i + 1}", model_dir, e2e, max(d["seconds"] for d in done),
            {"RssAnon": sum(d["RssAnon"] for d in done), "VmHWM": max(d["VmHWM"] for d in done)})
    ray.shutdown()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| step | checkpoint | end to end s | reading s | e2e / reading | shards' anon RSS GB (all ranks) "
             "| peak RSS GB (max rank, during the step) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | seed {r['seed']} | {r['e2e_s']:.2f} | {r['reading_s']:.2f} | "
                     f"{r['e2e_s'] / r['reading_s']:.2f} | {r['RssAnon'] / 1e9:.2f} | {r['VmHWM'] / 1e9:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reload", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--size-gb", type=float, default=2.0, help="size of each Llama-shaped checkpoint")
    ap.add_argument("--reloads", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    dirs = [ensure_checkpoint(ModelSpec(size_gb=args.size_gb, seed=seed)) for seed in range(3)]
    rows = run(args.tp, dirs, args.reloads)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
