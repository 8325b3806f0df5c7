"""python -m benchmarks.loaders: time and measure checkpoint loaders for tensor parallelism.

For each tp, placement (one node: all ranks at once; one rank per node: each rank
alone from a cold cache, one after another) and cache state (cold: the
checkpoint's pages evicted and checked gone before each run; warm: all resident),
each loader loads every rank's shards, each rank in its own process. Prints a table
and writes results.json, results.csv, results.md and loaders.png to --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import threading
import time

from . import diskstats, impls, pagecache, report, runner
from .checkpoint import ModelSpec, checkpoint_files, default_cache_dir, ensure_checkpoint
from .needs import node_needs, rank_needs

PLACEMENTS = ("node", "rank-per-node")
CACHES = ("cold", "warm")


def parse_args(argv):
    d = ModelSpec()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.loaders", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="use this checkpoint instead of building one")
    ap.add_argument("--cache-dir", default=None, help=f"where built checkpoints are kept (default {default_cache_dir()})")
    ap.add_argument("--out", default="bench-out", help="output directory (default bench-out/)")
    ap.add_argument("--tp", default="1,2,4", help="comma-separated tp values (default 1,2,4)")
    ap.add_argument("--loaders", default=",".join(impls.ALL_LOADERS),
                    help=f"comma-separated, from {','.join(impls.ALL_LOADERS)}")
    ap.add_argument("--placements", default=",".join(PLACEMENTS),
                    help="comma-separated, from node (all ranks at once on this node) and rank-per-node (each rank "
                         "alone from a cold cache, one after another)")
    ap.add_argument("--caches", default=",".join(CACHES),
                    help="cache states for one-node runs (rank-per-node runs are cold)")
    ap.add_argument("--runs", type=int, default=3, help="runs per loader and one-node scenario (default 3)")
    ap.add_argument("--warm-runs", type=int, default=2, help="runs per loader and warm one-node scenario (default 2)")
    ap.add_argument("--rank-node-runs", type=int, default=2,
                    help="runs per loader of each rank-per-node scenario, each rank alone in turn (default 2)")
    ap.add_argument("--no-verify", action="store_true", help="skip the checksum comparison with the reference")
    ap.add_argument("--size-gb", type=float, default=d.size_gb, help="checkpoint size when --layers is not given")
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--intermediate", type=int, default=d.intermediate)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=d.vocab)
    ap.add_argument("--shard-size", default=d.shard_size, help="save_pretrained max_shard_size")
    ap.add_argument("--threads", type=int, default=None, help="raylazy ranged: reader threads per rank")
    ap.add_argument("--chunk-mb", type=int, default=None, help="raylazy ranged: chunk_bytes in MiB")
    ap.add_argument("--max-gap", type=int, default=None, help="raylazy: max_gap of the plan (default raylazy's, 0)")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                    help="first wait up to this long for the 1-minute load average to drop below --quiet-load")
    ap.add_argument("--quiet-load", type=float, default=1.0)
    ap.add_argument("--gate-cpu", type=float, default=0.3, metavar="CORES",
                    help="before each run, wait while other processes use more than this many cores (default 0.3)")
    ap.add_argument("--gate-max-s", type=float, default=180.0, help="longest wait before one run (default 180 s)")
    ap.add_argument("--no-chart", action="store_true")
    return ap.parse_args(argv)


def _choices(flag: str, value: str, allowed: tuple) -> list[str]:
    """The comma-separated names of `value`, each one of `allowed`: any other name ends the program.

    A misspelt placement must not fall through to another scenario (`--placements one-node` once ran
    every rank alone, one after another, and was read as a one-node run).
    """
    names = [x for x in value.split(",") if x]
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        sys.exit(f"{flag}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; choose from {', '.join(allowed)}")
    return names


def wait_quiet(max_s: float, threshold: float, log=print) -> float:
    """Poll the 1-minute load average every 30 s until it is below `threshold` or `max_s` passed."""
    t0 = time.monotonic()
    while True:
        load1 = os.getloadavg()[0]
        if load1 < threshold or time.monotonic() - t0 >= max_s:
            log(f"load average {load1:.2f} after waiting {time.monotonic() - t0:.0f} s "
                f"({'quiet' if load1 < threshold else 'not quiet: running anyway'})")
            return time.monotonic() - t0
        time.sleep(min(30.0, max(0.0, max_s - (time.monotonic() - t0))))


def others_cpu(window_s: float = 0.5) -> float:
    """Cores busy over `window_s` in processes other than this one and its descendants (Ray included)."""
    import psutil

    def snap():
        me = psutil.Process()
        mine = 0.0
        for p in [me] + me.children(recursive=True):
            try:
                c = p.cpu_times()
                mine += c.user + c.system
            except psutil.Error:
                pass
        t = psutil.cpu_times()
        return time.monotonic(), t.user + t.nice + t.system + t.irq + t.softirq + t.steal, mine

    t0, b0, m0 = snap()
    time.sleep(window_s)
    t1, b1, m1 = snap()
    return max(0.0, ((b1 - b0) - (m1 - m0)) / (t1 - t0))


def gate(max_cores: float, max_s: float) -> tuple[float, float]:
    """Wait (up to max_s) until other processes use at most max_cores; returns (their cores, seconds waited)."""
    t0 = time.monotonic()
    while True:
        busy = others_cpu()
        if busy <= max_cores or time.monotonic() - t0 >= max_s:
            return busy, time.monotonic() - t0


def machine(model_dir: str) -> dict:
    import psutil

    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev, fstype, mnt = "?", "?", "/"
    best = ""
    for p in psutil.disk_partitions(all=True):
        if os.path.realpath(model_dir).startswith(p.mountpoint) and len(p.mountpoint) > len(best):
            best, dev, fstype, mnt = p.mountpoint, p.device, p.fstype, p.mountpoint
    ra = "?"
    name = os.path.basename(os.path.realpath(dev))
    for cand in (name, name.rstrip("0123456789")):
        try:
            ra = open(f"/sys/block/{cand}/queue/read_ahead_kb").read().strip() + " KiB"
            break
        except OSError:
            pass
    versions = {}
    for mod in ("torch", "ray", "safetensors", "fastsafetensors", "runai_model_streamer", "transformers"):
        try:
            from importlib.metadata import version

            versions[mod] = version(mod.replace("_", "-"))
        except Exception:  # noqa: BLE001
            versions[mod] = "?"
    return {"cpu": cpu, "cpus": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(), "disk": dev, "fs": fstype,
            "mount": mnt, "read_ahead": ra, "versions": versions}


def prepare_cache(cache: str, files: list[str], total: int) -> int:
    """Cold: evict and return the bytes still resident (0 expected). Warm: make all resident, return resident."""
    if cache == "cold":
        return pagecache.evict(files)
    have = pagecache.resident(files)
    if have < total:
        have = pagecache.warm(files)
    return have


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():  # a kill cleans up (rank processes, Ray) too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tps = [int(x) for x in args.tp.split(",")]
    loaders = _choices("--loaders", args.loaders, impls.ALL_LOADERS)
    placements = _choices("--placements", args.placements, PLACEMENTS)
    caches = _choices("--caches", args.caches, CACHES)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    spec = ModelSpec(hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, kv_heads=args.kv_heads,
                     layers=args.layers, vocab=args.vocab, size_gb=args.size_gb, shard_size=args.shard_size)
    model_dir = os.path.abspath(args.model_dir) if args.model_dir else ensure_checkpoint(spec, args.cache_dir)
    files = checkpoint_files(model_dir)
    total = sum(os.path.getsize(p) for p in files)
    total_pages = sum((os.path.getsize(p) + pagecache.PAGE - 1) // pagecache.PAGE for p in files) * pagecache.PAGE
    waited = wait_quiet(args.wait_quiet, args.quiet_load) if args.wait_quiet else 0.0
    env = machine(model_dir)
    disk = diskstats.Device(files)
    env.update(model_dir=model_dir, files=len(files), checkpoint_bytes=total, argv=sys.argv[1:] if argv is None else argv,
               storage_device=disk.name, storage_device_missing=disk.missing,
               model=spec.describe() if not args.model_dir else model_dir, load_before=os.getloadavg(),
               waited_for_quiet_s=round(waited, 1), started=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"checkpoint {model_dir}: {len(files)} files, {total / 1e9:.2f} GB; {env['cpu']} x{env['cpus']}, "
          f"{env['ram_gb']} GiB RAM, {env['fs']} on {env['disk']} (read-ahead {env['read_ahead']}); "
          f"load average {', '.join(f'{x:.2f}' for x in env['load_before'])}")
    print("bytes pulled from storage: " + (f"/proc/diskstats of {disk.name}, the node's reads as the device saw them"
                                            if disk.name else f"the loaders' processes' /proc/PID/io read_bytes ({disk.missing})"))
    reader = {}
    if args.threads:
        reader["threads"] = args.threads
    if args.chunk_mb:
        reader["chunk_bytes"] = args.chunk_mb << 20
    if args.max_gap is not None:
        reader["max_gap"] = args.max_gap
    own_ray = runner.init_ray(max(tps)) if any(l in impls.RAY_LOADERS for l in loaders) else False
    try:
        return _measure(args, tps, loaders, placements, caches, out, model_dir, files, total_pages, reader, env,
                        disk if disk.name else None)
    finally:
        if own_ray:
            import ray

            ray.shutdown()


def _measure(args, tps, loaders, placements, caches, out, model_dir, files, total_pages, reader, env, disk) -> int:
    import raylazy

    records: list[dict] = []
    verified: set = set()
    t_start = time.monotonic()
    for tp in tps:
        plan = raylazy.plan(model_dir, tp)
        plan_path = os.path.join(out, f"plan-tp{tp}.json")
        with open(plan_path, "w") as fh:
            fh.write(plan.to_json())
        needs = [rank_needs(rp) for rp in plan.ranks]
        node_pages = node_needs(plan)
        raw_needs = []
        for r in range(tp):
            share = impls.raw_share(files, tp, r)
            exact = sum(b - a for _, a, b in share)
            pages = sum(((b + pagecache.PAGE - 1) // pagecache.PAGE - a // pagecache.PAGE) * pagecache.PAGE
                        for _, a, b in share)
            raw_needs.append({"exact": exact, "pages": pages, "shard": 0})
        ref = None
        if not args.no_verify:
            ref = runner.reference_checksums(plan, files, os.path.join(out, f"reference-tp{tp}.json"))
        groups = {}
        try:
            for l in loaders:
                if l in impls.PROCESS_LOADERS:
                    groups[l] = runner.ProcessRanks(l, plan_path, tp, model_dir, os.path.join(out, "logs"))
            for g in groups.values():  # all started at once, imports overlap
                g.wait_ready()
            for placement in placements:
                if tp == 1 and placement != "node":
                    continue  # one rank alone on its node is the one-node run
                for cache in caches if placement == "node" else ["cold"]:
                    runs = args.rank_node_runs if placement != "node" else args.warm_runs if cache == "warm" else args.runs
                    for i in range(runs):
                        for loader in loaders[i % len(loaders):] + loaders[: i % len(loaders)]:
                            verify = ref is not None and loader != "raw" and (loader, tp) not in verified
                            rec = one_run(loader, tp, placement, cache, i, files, total_pages, groups, model_dir, reader,
                                          verify, ref, needs if loader != "raw" else raw_needs,
                                          node_pages if loader != "raw" else total_pages,
                                          (args.gate_cpu, args.gate_max_s) if args.gate_cpu > 0 else None, disk)
                            if rec["verified"] is not None:
                                verified.add((loader, tp))
                            records.append(rec)
                            print(_progress(rec, time.monotonic() - t_start), flush=True)
        finally:
            for g in groups.values():
                g.close()
    env["load_after"] = os.getloadavg()
    env["seconds"] = round(time.monotonic() - t_start, 1)
    rows = report.aggregate(records)
    print()
    print(report.table(rows))
    paths = report.write(out, rows, records, env)
    if not args.no_chart:
        paths["png"] = report.chart(rows, os.path.join(out, "loaders.png"),
                                    f"{env['model']}\n{env['cpu']} x{env['cpus']}, {env['fs']} on {env['disk']}")
    bad = [r for r in rows if r["verified"] == "MISMATCH"]
    print(f"\nmeasured in {env['seconds']:.0f} s; load average before {_la(env['load_before'])}, "
          f"after {_la(env['load_after'])}; wrote {', '.join(paths.values())}")
    if bad:
        print("SHARDS DIFFER FROM THE REFERENCE: " + ", ".join(f"{r['loader']} tp={r['tp']}" for r in bad))
        return 1
    return 0


def _la(x) -> str:
    return ", ".join(f"{v:.2f}" for v in x)


def one_run(loader, tp, placement, cache, index, files, total_pages, groups, model_dir, reader, verify, ref, needs,
            node_pages, gate_args=None, disk=None) -> dict:
    """One run of `loader`: all ranks at once (placement "node") or each alone after its own eviction.

    "pulled_bytes" is what the node pulled from storage: with `disk` (a diskstats.Device), what the device
    served while the ranks loaded plus the raylazy driver's planning reads (headers, just before); without,
    the sum of the loader's processes' read_bytes ("procs_read_bytes", recorded either way). On one rank
    per node each rank's part is its own.
    """
    parts = [list(range(tp))] if placement == "node" else [[r] for r in range(tp)]
    ranks, e2e, e2e_cpu, resident, checks, others, waited = [], [], [], [], {}, [], 0.0
    dev, pulled, procs = None, 0, 0
    load1 = os.getloadavg()[0]
    for active in parts:
        if gate_args:
            busy, w = gate(*gate_args)
            others.append(busy)
            waited += w
        resident.append(prepare_cache(cache, files, total_pages))
        if loader in impls.PROCESS_LOADERS:
            res = runner.run_process(groups[loader], active, verify, disk)
        else:
            spec = impls.RAY_LOADERS[loader]
            base = spec.alone if placement != "node" and spec.alone is not None else spec.options
            options = dict(base, **{k: v for k, v in reader.items() if k in spec.reader})
            res = runner.run_raylazy(model_dir, tp, options, None if placement == "node" else active, verify, disk)
            e2e.append(res["e2e_s"])
            e2e_cpu.append(res["e2e_cpu_s"])
        part_procs = sum(m["read_bytes"] for m in res["ranks"]) + res["driver_read_bytes"]
        part_pulled = res["disk"].bytes + res["driver_read_bytes"] if res["disk"] else part_procs
        for m in res["ranks"]:
            n = needs[m["rank"]]
            m.update(need_exact=n["exact"], need_pages=n["pages"])
            if placement != "node":  # the rank was alone
                m["pulled_bytes"] = part_pulled
        if res["disk"]:
            dev = res["disk"] if dev is None else dev + res["disk"]
        pulled, procs = pulled + part_pulled, procs + part_procs
        ranks += res["ranks"]
        checks.update(res["checksums"] or {})
    if placement == "node":
        wall = max(m["t_end"] for m in ranks) - min(m["t_start"] for m in ranks)
        need_pages = node_pages
    else:
        wall = max(m["wall_s"] for m in ranks)
        need_pages = sum(n["pages"] for n in needs)
    ok = None
    if verify:
        ok = all(checks.get(r) == ref[r] for r in range(tp))
    return {
        "loader": loader, "tp": tp, "placement": placement, "cache": cache, "run": index,
        "wall_s": wall, "e2e_s": max(e2e) if e2e else None, "e2e_cpu_s": sum(e2e_cpu) if e2e_cpu else None,
        "cpu_s": sum(m["cpu_s"] for m in ranks),
        "pulled_bytes": pulled, "procs_read_bytes": procs,
        "dev_read_bytes": dev.bytes if dev else None, "dev_requests": dev.requests if dev else None,
        "dev_merged": dev.merged if dev else None, "dev_mean_request": dev.mean_request if dev else None,
        "rchar": sum(m["rchar"] for m in ranks),
        "need_exact": sum(n["exact"] for n in needs), "need_pages": need_pages,
        "resident_before": max(resident) if cache == "cold" else min(resident), "load1": load1,
        "others_cores_before": max(others) if others else None, "gate_waited_s": waited,
        "verified": ok, "ranks": ranks,
    }


def _progress(rec: dict, elapsed: float) -> str:
    e2e = f" e2e {rec['e2e_s']:.2f} s" if rec.get("e2e_s") is not None else ""
    ok = {None: "", True: " verified", False: " MISMATCH"}[rec["verified"]]
    others = "" if rec.get("others_cores_before") is None else \
        f", others {rec['others_cores_before']:.2f} cores before, waited {rec['gate_waited_s']:.0f} s"
    return (f"[{elapsed:6.0f} s] tp={rec['tp']} {rec['placement']:<13} {rec['cache']:<4} run {rec['run']} "
            f"{rec['loader']:<15} wall {rec['wall_s']:6.2f} s{e2e} cpu {rec['cpu_s']:5.1f} s "
            f"pulled {rec['pulled_bytes'] / 1e9:5.2f} GB{_requests(rec)}{ok} (load {rec['load1']:.1f}{others})")


def _requests(rec: dict) -> str:
    if rec["dev_mean_request"] is None:
        return ""
    return f" in {rec['dev_requests']} requests of {rec['dev_mean_request'] / 1024:.0f} KiB"


if __name__ == "__main__":
    sys.exit(main())
