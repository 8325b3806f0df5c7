"""Where `raylazy.load`'s end-to-end seconds go, with fresh actors, and what cheap cuts save.

    python -m benchmarks.load_breakdown                       # tp 4 and 8, 0.5 GB checkpoint, cold
    python -m benchmarks.load_breakdown --tp 4 --runs 3 --variants default,prestart+hook

Each variant runs in its own process with its own local Ray (`ray.init` is timed there), then
loads every tp `--runs` times from a cold cache, one `raylazy.load` (new placement group, new
actors) each. Wall-clock timestamps, in seconds from the `raylazy.load` call:

- on the driver, by wrapping (at run time, in this process only) the steps of `raylazy.cluster.loading.Load`:
  `RankGroup.create` (placement group and actors submitted), `make_plan` (headers read),
  `Load._ready` (group placed, every actor constructed), `Load._wait_reads` (loads);
- in each actor, through a `RankLoader` subclass passed as `actor_cls`: its process's start,
  entering `__init__` (worker booted, class unpickled), torch imported (`RankLoader.__init__`
  done), and its `load`.

Variants: `default` (a plain `ray.init`: a Ray started without raylazy's settings), `preload` (the workers import
torch and raylazy's readers as they start, as in the local Ray `raylazy.load` starts itself), `by-value` (the actor class
pickled by value, as the loaders benchmark does for clusters that cannot import `benchmarks`),
`prestart` (tp idle workers started before the call by tp tasks that each hold a worker for 1 s, as
long-lived inference workers would be), `hook` (`runtime_env={"worker_process_setup_hook": ...}` imports torch in
every worker as it boots) and `prestart+hook`. Prints one table; `--json` saves every load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from raylazy.cluster.actor import RankLoader

VARIANTS = ("default", "preload", "by-value", "prestart", "hook", "prestart+hook")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_torch() -> None:
    """worker_process_setup_hook of the `hook` variants: every Ray worker imports torch as it boots."""
    import torch  # noqa: F401


class TimedRankLoader(RankLoader):
    """raylazy's rank actor, recording wall-clock times of its start-up and its load."""

    def __init__(self, rank: int, device: str = "auto"):
        entered = time.time()
        torch_before = "torch" in sys.modules
        super().__init__(rank, device)
        import psutil

        self.times_ = {"proc_start": psutil.Process().create_time(), "init_enter": entered,
                       "torch_imported": time.time(), "torch_before": torch_before}

    def load(self, plan, options, node_read=None):
        start = time.time()
        stats = super().load(plan, options, node_read)
        self.times_.update(load_start=start, load_end=time.time())
        return stats

    def times(self) -> dict:
        return self.times_


def _timed(owner, name: str, marks: dict, key: str) -> None:
    """Replace owner.name by a wrapper that records (start, end) wall-clock times in marks[key]."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            marks[key] = (t, time.time())

    setattr(owner, name, wrapper)


def child(variant: str, tps: list[int], runs: int, model_dir: str) -> None:
    """One variant in this process: its own Ray, then `runs` loads per tp; one JSON line per result."""
    t0 = time.time()
    import ray

    import raylazy
    import raylazy.cluster.loading as loading
    from benchmarks.load_breakdown import TimedRankLoader as actor_cls  # by reference: not __main__'s copy
    from benchmarks.loaders.__main__ import gate
    from benchmarks.loaders.checkpoint import checkpoint_files
    from benchmarks.loaders.pagecache import evict
    from raylazy.cluster.group import RankGroup
    from raylazy.cluster.loading import Load

    imported = time.time() - t0
    if variant == "by-value":
        from ray import cloudpickle

        import benchmarks

        cloudpickle.register_pickle_by_value(benchmarks)
    env = {"worker_process_setup_hook": "benchmarks.load_breakdown.import_torch"} if "hook" in variant else None
    t = time.time()
    from raylazy.cluster.bundles import PRELOAD

    preload = {"_system_config": {"preload_python_modules": list(PRELOAD)}} if variant == "preload" else {}
    ray.init(address="local", num_cpus=max(tps), include_dashboard=False, log_to_driver=False,
             logging_level="WARNING", runtime_env=env, **preload)
    print(json.dumps({"variant": variant, "import_s": imported, "ray_init_s": time.time() - t}), flush=True)
    marks: dict = {}
    _timed(RankGroup, "create", marks, "create")
    _timed(Load, "_ready", marks, "ready")
    _timed(loading, "make_plan", marks, "plan")
    _timed(Load, "_wait_reads", marks, "loads")

    @ray.remote(num_cpus=1)
    def noop() -> int:
        time.sleep(1.0)  # long enough that the tp tasks hold tp workers at once
        return os.getpid()

    files = checkpoint_files(model_dir)
    for tp in tps:
        for run in range(runs):
            if "prestart" in variant:  # tp workers exist and sit idle before the call
                ray.get([noop.remote() for _ in range(tp)])
            gate(0.3, 30.0)
            evict(files)
            marks.clear()
            t = time.time()
            loaded = raylazy.load(model_dir, tp, device="cpu", use_gpu=False, progress=False,
                                  actor_cls=actor_cls)
            end = time.time()
            actors = ray.get([a.times.remote() for a in loaded.actors])
            pids = [i.pid for i in loaded.ranks]
            loaded.release()
            rel = {k: [x - t for x in v] for k, v in marks.items()}
            print(json.dumps({"variant": variant, "tp": tp, "run": run, "e2e": end - t, "driver": rel,
                              "actors": [{k: (v - t if isinstance(v, float) else v) for k, v in a.items()}
                                         for a in actors]}), flush=True)
            _wait_gone(pids)
    ray.shutdown()


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)


COLUMNS = (  # (header, value from one load's record) in seconds from the raylazy.load call
    ("group created", lambda r: r["driver"]["create"][1]),
    ("plan start-end", lambda r: r["driver"]["plan"]),
    ("proc start (max)", lambda r: max(a["proc_start"] for a in r["actors"])),
    ("__init__ (max)", lambda r: max(a["init_enter"] for a in r["actors"])),
    ("torch imported (max)", lambda r: max(a["torch_imported"] for a in r["actors"])),
    ("all ready", lambda r: r["driver"]["ready"][1]),
    ("load start (min)", lambda r: min(a["load_start"] for a in r["actors"])),
    ("load end (max)", lambda r: max(a["load_end"] for a in r["actors"])),
    ("returned", lambda r: r["e2e"]),
    ("torch import s/rank", lambda r: statistics.median(a["torch_imported"] - a["init_enter"] for a in r["actors"])),
    ("boot s/rank", lambda r: statistics.median(a["init_enter"] - a["proc_start"] for a in r["actors"])),
    ("prestarted", lambda r: sum(a["proc_start"] < 0 for a in r["actors"])),
)


def _cell(values) -> str:
    if isinstance(values[0], (list, tuple)):
        return f"{statistics.median(v[0] for v in values):.2f}-{statistics.median(v[1] for v in values):.2f}"
    m = statistics.median(values)
    return f"{m:.0f}" if all(isinstance(v, (bool, int)) for v in values) else f"{m:.2f}"


def table(inits: dict, loads: list[dict]) -> str:
    head = ("variant", "tp", "ray.init s") + tuple(h for h, _ in COLUMNS)
    lines = [head]
    for variant in inits:
        for tp in sorted({r["tp"] for r in loads if r["variant"] == variant}):
            recs = [r for r in loads if r["variant"] == variant and r["tp"] == tp]
            lines.append((variant, str(tp), f"{inits[variant]['ray_init_s']:.2f}")
                         + tuple(_cell([fn(r) for r in recs]) for _, fn in COLUMNS))
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(l, widths)) for l in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.load_breakdown", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="4,8")
    ap.add_argument("--runs", type=int, default=2, help="loads per variant and tp (median shown)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    ap.add_argument("--size-gb", type=float, default=0.5, help="size of the benchmark's Llama-shaped checkpoint")
    ap.add_argument("--model-dir", help="use this checkpoint instead")
    ap.add_argument("--json", help="write every load's timestamps here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tps = [int(x) for x in args.tp.split(",")]
    if args.child:
        child(args.child, tps, args.runs, args.model_dir)
        return 0
    from .loaders.checkpoint import ModelSpec, ensure_checkpoint

    model_dir = os.path.abspath(args.model_dir) if args.model_dir else ensure_checkpoint(ModelSpec(size_gb=args.size_gb))
    variants = [v for v in args.variants.split(",") if v]
    if set(variants) - set(VARIANTS):
        sys.exit(f"unknown variant(s) {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    inits, loads = {}, []
    for variant in variants:
        out = subprocess.run([sys.executable, "-m", "benchmarks.load_breakdown", "--child", variant, "--tp", args.tp,
                              "--runs", str(args.runs), "--model-dir", model_dir],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
        for line in out.splitlines():
            rec = json.loads(line)
            if "tp" in rec:
                loads.append(rec)
            else:
                inits[variant] = rec
        print(f"{variant}: done", file=sys.stderr, flush=True)
    print(f"seconds from the raylazy.load call (medians of {args.runs} loads; a-b: start-end); {model_dir}; "
          f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(table(inits, loads))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"inits": inits, "loads": loads}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
