"""Where `raylazy.load`'s end-to-end seconds go, with fresh actors, and what cheap cuts save.

    python -m benchmarks.load_breakdown                       # tp 4 and 8, 0.5 GB checkpoint, cold
    python -m benchmarks.load_breakdown --tp 4 --runs 3 --variants default,prestart+hook
    python -m benchmarks.load_breakdown --naive --tp 4 --size-gb 1.7 --runs 5 --variants ahead,preload

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
every worker as it boots), `prestart+hook`, and `ahead` (the `preload` Ray started ahead of the load, as a
cluster is: it starts as many workers as ranks, and the load waits until they have imported torch and sit idle).
Prints one table; `--json` saves every load.

`--naive`: side by side with a naive loader whose tp processes were started (and imported torch) before the
run, alternating in one run: each repetition loads once in each variant (a fresh Ray each: its first load) and
once naively (`safe_open`, `get_tensor`, `narrow().clone()` per rank), every load cold (the checkpoint's pages
evicted with `posix_fadvise(DONTNEED)`). Prints each variant's end to end, its ratio to the naive loader of the
same repetition, and its split (`LoadedModel.phases`: start, plan, ready, read), medians and ranges. `--before
DIR` runs each variant from a checkout of another commit too (this file copied in), in the same alternation.
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

VARIANTS = ("default", "preload", "by-value", "prestart", "hook", "prestart+hook", "ahead")
#: The start-up goal: `raylazy.load` end to end with fresh actors at most this times the naive loader's.
GOAL = 1.3
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
                       "torch_imported": time.time(), "torch_before": torch_before, "pid": os.getpid()}

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
    from raylazy.cluster.bundles import worker_config

    config = worker_config(max(tps)) if variant in ("preload", "ahead") else {}
    if variant == "ahead":  # Ray starts as many workers as it has CPUs, at most this many at once (default: cores)
        config["worker_maximum_startup_concurrency"] = max(tps)
    ray.init(address="local", num_cpus=max(tps), include_dashboard=False, log_to_driver=False,
             logging_level="WARNING", runtime_env=env, _system_config=config)
    if variant == "ahead":
        idle_workers(max(tps))
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
            pool = idle_workers()
            t = time.time()
            loaded = raylazy.load(model_dir, tp, device="cpu", use_gpu=False, progress=False,
                                  actor_cls=actor_cls)
            end = time.time()
            actors = ray.get([a.times.remote() for a in loaded.actors])
            pids = [i.pid for i in loaded.ranks]
            loaded.release()
            rel = {k: [x - t for x in v] for k, v in marks.items()}
            print(json.dumps({"variant": variant, "tp": tp, "run": run, "e2e": end - t, "driver": rel,
                              "phases": loaded.phases, "pool": sorted(pool),
                              "actors": [{k: (v - t if isinstance(v, float) else v) for k, v in a.items()}
                                         for a in actors]}), flush=True)
            _wait_gone(pids)
    ray.shutdown()


def idle_workers(wanted: int = 0, timeout_s: float = 120.0) -> set[int]:
    """The pids of this Ray's idle workers (`ray::IDLE`, this process's descendants); with `wanted`, first wait
    until that many are up and done importing, or `timeout_s` passed: each has torch mapped, sleeps, and used no
    CPU for 0.5 s (starved of CPU on a busy machine, a worker still importing is runnable, not sleeping)."""
    import psutil

    def idle() -> dict[int, tuple]:
        out = {}
        for p in psutil.Process().children(recursive=True):
            try:
                if p.cmdline()[:1] == ["ray::IDLE"]:
                    with open(f"/proc/{p.pid}/maps") as fh:
                        torch = "libtorch_cpu" in fh.read()
                    c = p.cpu_times()
                    out[p.pid] = (c.user + c.system, torch and p.status() == psutil.STATUS_SLEEPING)
            except (psutil.Error, OSError):
                pass
        return out

    deadline = time.monotonic() + timeout_s
    before = idle()
    while wanted and time.monotonic() < deadline:
        time.sleep(0.5)
        now = idle()
        if len(now) >= wanted and now == before and all(done for _, done in now.values()):
            break
        before = now
    return set(before)


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
    ("prestarted", lambda r: sum(a["pid"] in r["pool"] for a in r["actors"])),
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
            lines.append((variant, str(tp), f"{statistics.median(i['ray_init_s'] for i in inits[variant]):.2f}")
                         + tuple(_cell([fn(r) for r in recs]) for _, fn in COLUMNS))
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(l, widths)) for l in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def run_child(variant: str, tp: str, runs: int, model_dir: str, inits: dict, loads: list, root: str = ROOT,
              label: str = "") -> None:
    """One variant's process (its own Ray, `runs` loads per tp) run from the checkout `root`; its records, the
    variant named with `label`, added to `inits` and `loads`."""
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "benchmarks.load_breakdown", "--child", variant, "--tp", tp,
                          "--runs", str(runs), "--model-dir", model_dir],
                         cwd=root, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    for line in out.splitlines():
        rec = dict(json.loads(line), variant=variant + label)
        if "tp" in rec:
            loads.append(rec)
        else:
            inits.setdefault(rec["variant"], []).append(rec)


def side_by_side(variants: list[str], tp: int, runs: int, model_dir: str, inits: dict, loads: list,
                 before: str | None = None) -> None:
    """`runs` repetitions, each one load per variant (a fresh process and Ray each; with `before`, a checkout of
    another commit, also each variant from there) and one by the naive loader in tp processes started before the
    first; the order rotates each repetition; every load cold. A variant whose process fails (a Ray that could
    not start on a busy machine) is tried once more."""
    import tempfile

    import raylazy

    from .loaders.__main__ import gate
    from .loaders.checkpoint import checkpoint_files
    from .loaders.pagecache import evict
    from .loaders.runner import ProcessRanks

    files = checkpoint_files(model_dir)
    with tempfile.TemporaryDirectory(prefix="raylazy-startup-") as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w") as fh:
            fh.write(raylazy.plan(model_dir, tp).to_json())
        naive = ProcessRanks("naive", plan_path, tp, model_dir, tmp).wait_ready()
        try:
            trees = [(ROOT, "")] + ([(os.path.abspath(before), " (before)")] if before else [])
            for run in range(runs):
                order = [*((v, *tree) for tree in trees for v in variants), "naive"]
                for variant in order[run % len(order):] + order[: run % len(order)]:
                    if variant != "naive":
                        for attempt in (1, 2):
                            try:
                                run_child(variant[0], str(tp), 1, model_dir, inits, loads, *variant[1:])
                            except subprocess.CalledProcessError:
                                print(f"{''.join(variant[::2])} failed (attempt {attempt})", file=sys.stderr)
                                continue
                            loads[-1]["run"] = run
                            print(json.dumps(loads[-1]), file=sys.stderr, flush=True)
                            break
                        continue
                    gate(0.3, 30.0)
                    evict(files)
                    t = time.time()
                    naive.send(list(range(tp)), "run")
                    loads.append({"variant": "naive", "tp": tp, "run": run, "e2e": time.time() - t})
                    print(json.dumps(loads[-1]), file=sys.stderr, flush=True)
                    naive.send(list(range(tp)), "free")
                print(f"repetition {run + 1} of {runs}: done", file=sys.stderr, flush=True)
        finally:
            naive.close()


def _range(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def ratios(loads: list[dict]) -> str:
    """Each variant's end to end beside the naive loader's of the same repetition, its split, and the goal."""
    naive = {r["run"]: r["e2e"] for r in loads if r["variant"] == "naive"}
    lines = [f"naive loader, processes started before: {_range(list(naive.values()))} s"]
    for variant in dict.fromkeys(r["variant"] for r in loads if r["variant"] != "naive"):
        recs = [r for r in loads if r["variant"] == variant]
        x = [r["e2e"] / naive[r["run"]] for r in recs]
        split = ", ".join(f"{k} {_range([r['phases'].get(k, 0.0) for r in recs])}" for k in recs[0]["phases"]
                          if k != "copy")
        met = "met" if statistics.median(x) <= GOAL else "NOT met"
        lines.append(f"{variant}: raylazy.load end to end {_range([r['e2e'] for r in recs])} s = "
                     f"{_range(x)} x naive (goal {GOAL} x: {met}); split {split} s; ranks on workers started "
                     f"before the call {_range([sum(a['pid'] in r['pool'] for a in r['actors']) for r in recs], 0)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.load_breakdown", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", default="4,8")
    ap.add_argument("--runs", type=int, default=2, help="loads per variant and tp (median shown)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    ap.add_argument("--size-gb", type=float, default=0.5, help="size of the benchmark's Llama-shaped checkpoint")
    ap.add_argument("--model-dir", help="use this checkpoint instead")
    ap.add_argument("--naive", action="store_true",
                    help="alternate with a naive loader in processes started before (one tp); print the ratios")
    ap.add_argument("--before", metavar="DIR", help="with --naive: also run each variant from this checkout of "
                    "another commit (`git worktree add DIR COMMIT`, this file copied in), in the same alternation")
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
    if args.naive and len(tps) != 1:
        sys.exit("--naive compares one tp: give --tp N")
    inits, loads = {}, []
    load_before = os.getloadavg()
    if args.naive:
        side_by_side(variants, tps[0], args.runs, model_dir, inits, loads, args.before)
    for variant in variants if not args.naive else ():
        run_child(variant, args.tp, args.runs, model_dir, inits, loads)
        print(f"{variant}: done", file=sys.stderr, flush=True)
    print(f"seconds from the raylazy.load call (medians of {args.runs} loads; a-b: start-end); {model_dir}; "
          f"load average {', '.join(f'{x:.2f}' for x in load_before)} before, "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} after")
    print(table(inits, [r for r in loads if r["variant"] != "naive"]))
    if args.naive:
        print(ratios(loads))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"inits": inits, "loads": loads}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
