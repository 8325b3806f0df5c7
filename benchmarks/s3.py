"""raylazy beside the Run:ai model streamer's S3 mode and a plain sequential GET of the same bytes, on SeaweedFS
behind the counting proxy of benchmarks/s3server.py: per rank alone and per node (ranks sharing it), seconds,
GB/s, bytes fetched / needed and requests; and the planning's requests.

    python -m benchmarks.s3                                   # ~0.34 GB Llama-shaped checkpoint, tp 1, 2, 4
    python -m benchmarks.s3 --tp 2 4 --repeat 2 --out bench-s3
    python -m benchmarks.s3 --first-byte-ms 30 --connection-mbps 50     # a remote store, emulated by the proxy
    python -m benchmarks.s3 --extremes --tp 2 4               # also every row-split read whole / row by row
    python -m benchmarks.s3 --plan-before /path/to/an/older/checkout     # its planning's requests, for comparison
    python -m benchmarks.s3 --tp 2 4 --no-alone --no-proxy    # straight to SeaweedFS: what the proxy costs each loader

Loaders, each rank in a fresh process and one process (or node) at a time, so the proxy's counts are its own;
seconds are the load call only (not starting Python or importing torch):
  raylazy        a rank alone: `read_rank_ranged` of its plan (row-split reads whole or row by row, as the
                 storage's cost model estimates sooner; the `est. s` column is that model's estimate);
                 a node: what `raylazy.load` reads CPU ranks sharing a node with, its ranks' processes fetching
                 the node's stripes once into stages in shared memory and copying out of them (`cooperative`).
  exchange       a node: its ranks' processes exchange the stripes each fetched (`read_rank_exchanged`, gloo),
                 what GPU ranks read with (over NCCL).
  runai          `SafetensorsStreamer` over the s3:// files, each tensor then cut to the rank's shard; a node:
                 its distributed mode (RUNAI_STREAMER_DIST=1 over gloo: each process reads a part, broadcasts).
  get            one plain sequential GET stream (obstore) of as many bytes as the rank needs (a node: of every
                 file, the node's union), its chunks dropped: the physical limit here. `get (direct)`: the same,
                 not through the proxy.
  get-memory     a node: the same GET stream, each file's bytes copied into a fresh buffer of its size, as any
                 loader must land them in memory (the page faults and the copy a plain GET does not make).
  raylazy-exact, raylazy-whole (`--extremes`, rank 0)  max_gap=0 (the needed bytes, one request per row) and every
                 row-split read fetched whole, with the cost model's estimate of each.
`CPU s`: the loader's processes' CPU seconds (user + system) during the load; the store and the proxy share the
same cores. Before the loaders the store's rates are measured (`Bench.calibrate`) and given to raylazy's cost model.
Shards must be bit-identical across loaders (sha1 per rank), else the run fails. A node's time is its slowest rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from .loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint

BUCKET = "bench"
ALONE = ("raylazy", "runai", "get")
EXTREMES = ("raylazy-exact", "raylazy-whole")
NODE = ("raylazy", "exchange", "runai", "get", "get-memory")
_GAPS = {"raylazy": None, "raylazy-exact": 0, "raylazy-whole": 1 << 40}


def _worker(spec: dict) -> dict:
    import torch

    from raylazy.core.plans import Plan

    with open(spec["plan"]) as f:
        plan = Plan.from_json(f.read())
    rp, world = plan.ranks[spec["rank"]], spec.get("world", 0)
    import obstore  # noqa: F401  (imported before the clock starts, as every loader's modules)
    import runai_model_streamer  # noqa: F401

    import raylazy.io.backends  # noqa: F401  (every reader)
    import raylazy.io.nodes  # noqa: F401  (a node's read)
    import raylazy.storage.objects  # noqa: F401  (object storage's sources, imported by the first open)

    from .loaders import impls  # Run:ai's loader, and the checksums after the clock

    if world and spec["loader"] == "runai":
        torch.distributed.init_process_group("gloo", init_method=f"file://{spec['barrier']}.store", rank=spec["rank"],
                                             world_size=world)
    elif world and spec["loader"] == "exchange":
        from raylazy.io.collective import meet_through

        spec["address"] = meet_through(f"{spec['barrier']}.address", spec["rank"], 120.0)
    if world:
        _barrier(spec["barrier"], spec["rank"], world)
    t0, c0 = time.perf_counter(), _cpu_s()
    shards = _load(torch, spec["loader"], plan, rp, spec)
    seconds, cpu_s = time.perf_counter() - t0, _cpu_s() - c0
    if shards is None:
        return {"seconds": seconds, "cpu_s": cpu_s, "digest": None}
    sums = impls.checksums(shards)
    return {"seconds": seconds, "cpu_s": cpu_s,
            "digest": hashlib.sha1(json.dumps(sums, sort_keys=True).encode()).hexdigest()}


def _cpu_s() -> float:
    """This process's CPU seconds so far, user and system."""
    import resource

    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _barrier(prefix: str, rank: int, world: int) -> None:
    """Wait until the node's `world` processes have all started (each leaves a file), so a node's clock starts
    once every process has imported its modules, not while one is still starting."""
    open(f"{prefix}.{rank}", "w").close()
    while not all(os.path.exists(f"{prefix}.{r}") for r in range(world)):
        time.sleep(0.01)


def _load(torch, loader: str, plan, rp, spec: dict):
    from raylazy.core.options import ReaderOptions
    from raylazy.storage import storage_for

    from .loaders import impls

    # shaped for the store as raylazy.load shapes them (its GETs in flight, its part size)
    options = ReaderOptions(storage_options=spec["options"]).shaped(
        storage_for(plan.root, spec["options"]).cost_model(plan.root))
    if loader.startswith("get"):
        _plain_get(plan, spec["options"], spec["get_bytes"], into=loader == "get-memory")
        return None
    if loader == "runai":
        return impls.load_runai(torch, rp, [f.uri for f in plan.files], distributed=bool(spec.get("world")))
    if spec.get("world"):
        from raylazy.io.backends import read_rank
        from raylazy.io.nodes import node_read

        backend = "exchange" if loader == "exchange" else "cooperative"  # raylazy: what "auto" picks on CPUs
        task = node_read(backend, plan, plan.nodes[0], spec["load_id"], spec.get("address", ""))
        return read_rank(rp, "cpu", node_read=task, options=options.model_copy(update={"backend": backend}))[0]
    from raylazy.io.ranged import read_rank_ranged

    return read_rank_ranged(rp, "cpu", options=options)[0]


def _plain_get(plan, options: dict, nbytes: int, into: bool = False) -> None:
    """GET the files' first `nbytes` bytes (laid end to end), one file after another, one stream; `into`: each
    file's bytes copied into a fresh buffer, else its chunks dropped."""
    import numpy as np
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=options["endpoint"], allow_http=True, access_key_id=options["access_key_id"],
                    secret_access_key=options["secret_access_key"], region=options["region"])
    for f in plan.files:
        n = min(nbytes, f.size)
        if n <= 0:
            break
        out, got = memoryview(np.empty(n if into else 0, dtype=np.uint8)), 0
        for chunk in obstore.get(store, f.uri.split(f"{BUCKET}/", 1)[1], options={"range": (0, n)}).stream(
                min_chunk_size=8 << 20):
            if into:
                out[got : got + len(chunk)] = memoryview(chunk)
            got += len(chunk)
        assert got == n, (f.uri, got, n)
        nbytes -= n


def _env(server) -> dict:
    """The standard environment for both clients (Run:ai's reads only this; raylazy gets storage_options too)."""
    return dict(os.environ, **server.environment(), RUNAI_STREAMER_DIST="1", RUNAI_STREAMER_S3_TIMEOUT="600")


def _spawn(specs: list[dict], env: dict) -> list[dict]:
    """Run the worker of each spec in a process of its own, all at once; their results."""
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.s3", "--worker", json.dumps(s)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in specs]
    outs = [p.communicate(timeout=1800) for p in procs]
    for spec, p, (_, err) in zip(specs, procs, outs):
        if p.returncode:
            raise RuntimeError(f"{spec['loader']} rank {spec['rank']} failed:\n{err[-3000:]}")
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


class Bench:
    """One server, one checkpoint in it; rows measured in turn."""

    def __init__(self, server, uri: str, options: dict, out: str, log=print):
        self.server, self.uri, self.options, self.out, self.log = server, uri, options, out, log
        self.env, self.rows, self.digests = _env(server), [], {}

    def plan(self, tp: int, loader: str, nodes: bool = False, direct: bool = False):
        from raylazy.core.options import ReaderOptions
        from raylazy.core.schedule import with_node_schedules
        from raylazy.planning import make_plan
        from raylazy.storage import storage_for

        plan = make_plan(self.uri, tp, storage_options=self.options, max_gap=_GAPS.get(loader))
        if nodes:
            stripe = ReaderOptions().shaped(storage_for(self.uri, self.options).cost_model(self.uri)).stripe_bytes
            plan = with_node_schedules(plan, ["node"] * tp, stripe, direct=direct)  # as raylazy.load's node reads
        path = os.path.join(self.out, f"plan-{loader}-tp{tp}{'-node' if nodes else ''}{'-direct' if direct else ''}.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        return plan, path

    def planning(self, tp: int, before: str | None) -> None:
        """Requests and bytes of planning (the driver's discovery and header reads), and of an older checkout's."""
        for label, root in [("plan", None)] + ([("plan (before)", before)] if before else []):
            self.server.reset()
            if root is None:
                self.plan(tp, "raylazy")
            else:
                code = (f"from raylazy.planning import make_plan; make_plan({self.uri!r}, {tp}, "
                        f"storage_options={self.options!r})")
                subprocess.run([sys.executable, "-c", code], env=dict(self.env, PYTHONPATH=root), cwd=root, check=True)
            c = self.server.reset()
            self._row(dict(loader=label, mode="driver", tp=tp, rank="-", seconds=None, needed=0,
                           bytes=sum(r.body_bytes for r in c.requests), requests=len(c.requests),
                           in_flight=c.most_in_flight))

    def alone(self, tp: int, rank: int, loader: str) -> None:
        plan, path = self.plan(tp, loader if loader.startswith("raylazy") else "raylazy")
        rp = plan.ranks[rank]
        spec = dict(loader=loader, plan=path, rank=rank, options=self.options, get_bytes=rp.stats.bytes_needed)
        self.server.reset()
        (res,) = _spawn([spec], self.env)
        self._count(res, dict(loader=loader, mode="rank", tp=tp, rank=rank, needed=rp.stats.bytes_needed,
                              estimate=self._estimate(rp) if loader.startswith("raylazy") else None), (tp, rank))

    def node(self, tp: int, loader: str) -> None:
        # staged cooperative reads fetch what one rank alone keeps into its shard (`NodeSchedule.direct`)
        plan, path = self.plan(tp, "raylazy", nodes=loader in ("raylazy", "exchange"), direct=loader == "raylazy")
        union = sum(f.size for f in plan.files)
        barrier = os.path.join(self.out, f"ready-{time.monotonic_ns()}")
        specs = [dict(loader=loader, plan=path, rank=r, world=tp, barrier=barrier, load_id=os.path.basename(barrier),
                      options=self.options, get_bytes=union) for r in range(1 if loader.startswith("get") else tp)]
        if loader.startswith("get"):
            specs[0].pop("world")
        self.server.reset()
        results = _spawn(specs, self.env)
        for r, res in enumerate(results):
            if res["digest"]:
                self.digests.setdefault((tp, r), set()).add(res["digest"])
        slowest = max(results, key=lambda res: res["seconds"])
        self._count(dict(slowest, digest=None, cpu_s=sum(res["cpu_s"] for res in results)),
                    dict(loader=loader, mode="node", tp=tp, rank=f"0-{tp - 1}",
                                                     needed=union if loader.startswith("get") else plan.bytes_needed))

    def direct_get(self, tp: int) -> None:
        """The node's union by one plain GET stream straight from SeaweedFS (what the proxy costs)."""
        plan, path = self.plan(tp, "raylazy")
        union = sum(f.size for f in plan.files)
        options = dict(self.options, endpoint=self.server.direct)
        (res,) = _spawn([dict(loader="get", plan=path, rank=0, options=options, get_bytes=union)], self.env)
        self._row(dict(loader="get (direct)", mode="node", tp=tp, rank="-", seconds=res["seconds"], cpu_s=res["cpu_s"],
                       needed=union,
                       bytes=union, requests=len(plan.files), in_flight=1))

    def calibrate(self) -> None:
        """The store's rates, given to raylazy's cost model as storage options (as a user who knows the store would):
        `bandwidth`, the bytes a second of every file fetched in 8 MiB ranges, 16 at once (all connections together:
        one stream's rate is one connection's, which a store serving each at its own rate would take for the whole
        store's); `request_rate`, the GETs a second of a burst of small ones, 32 at once. (Its latency and one
        connection's rate it measures itself on the planning's GETs.)"""
        import obstore
        from obstore.store import S3Store

        plan, _ = self.plan(1, "raylazy")
        store = S3Store(BUCKET, endpoint=self.options["endpoint"], allow_http=True, **self.server.credentials)
        keys = [f.uri.split(f"{BUCKET}/", 1)[1] for f in plan.files]
        ranges = [(k, a, min(a + (8 << 20), f.size)) for k, f in zip(keys, plan.files) for a in range(0, f.size, 8 << 20)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            got = sum(pool.map(lambda r: len(obstore.get(store, r[0], options={"range": r[1:]}).bytes()), ranges))
        bandwidth = got / (time.perf_counter() - t0)
        n, span = 1000, max(1, plan.files[0].size // 4096)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda i: obstore.get(store, keys[0], options={"range": (i % span * 4096, i % span * 4096 + 4096)})
                          .bytes(), range(n)))
        rate = n / (time.perf_counter() - t0)
        self.options = dict(self.options, bandwidth=bandwidth, request_rate=rate)
        self.server.reset()
        self.log(f"calibrated: bandwidth {bandwidth / 1e9:.2f} GB/s, {rate:.0f} GETs/s")

    def _estimate(self, rp) -> float:
        from raylazy.storage import storage_for

        return storage_for(self.uri, self.options).cost_model(self.uri).rank_seconds(rp)

    def _count(self, res: dict, row: dict, key=None) -> None:
        c = self.server.reset()
        if key and res["digest"]:
            self.digests.setdefault(key, set()).add(res["digest"])
        counted = self.options["endpoint"] == self.server.endpoint
        self._row(dict(row, seconds=res["seconds"], cpu_s=res["cpu_s"], bytes=c.get_bytes() if counted else None,
                       requests=len(c.requests) if counted else None, in_flight=c.most_in_flight if counted else None))

    def _row(self, row: dict) -> None:
        self.rows.append(row)
        self.log(_line(row))

    def check(self) -> None:
        bad = sorted(k for k, d in self.digests.items() if len(d) != 1)
        if bad:
            raise RuntimeError(f"loaders disagree on the shards of (tp, rank) {bad}")


def run(model_dir: str, tps: list[int], out: str, repeat: int = 1, extremes: bool = False, nodes: bool = True,
        alone: bool = True, first_byte_s: float = 0.0, connection_bps: float = 0.0, plan_before: str | None = None,
        proxy: bool = True, log=print) -> list[dict]:
    from .s3server import S3Server

    server = S3Server()
    server.first_byte_s, server.connection_bps = first_byte_s, connection_bps
    try:
        uri = server.upload_dir(model_dir, BUCKET, "model")
        # without the proxy nothing is counted (requests and bytes: None) and nothing is emulated
        bench = Bench(server, uri, dict(endpoint=server.endpoint if proxy else server.direct, allow_http="true",
                                        **server.credentials), out, log)
        for tp in tps if proxy else ():
            bench.planning(tp, plan_before)
        bench.calibrate()
        for tp in tps:
            for rank in range(tp if alone else 0):
                for _ in range(repeat):  # alternating: each loader in turn, then again
                    for loader in ALONE + (EXTREMES if extremes and rank == 0 else ()):
                        bench.alone(tp, rank, loader)
            for _ in range(repeat if nodes and tp > 1 else 0):
                for loader in NODE:
                    bench.node(tp, loader)
            if nodes and tp > 1 and not first_byte_s and not connection_bps and proxy:
                bench.direct_get(tp)
        bench.check()
    finally:
        server.close()
    return bench.rows


def _line(r: dict) -> str:
    secs = f"{r['seconds']:.2f} s" if r["seconds"] is not None else "-"
    rate = f", {r['needed'] / r['seconds'] / 1e9:.2f} GB/s" if r["seconds"] and r["needed"] else ""
    cpu = f", CPU {r['cpu_s']:.2f} s" if r.get("cpu_s") is not None else ""
    return (f"{r['loader']:>14} {r['mode']:>6} tp={r['tp']} rank {r['rank']}: {secs}{rate}{cpu}, "
            + (f"{r['bytes'] / 1e6:.1f} MB in {r['requests']} requests (at most {r['in_flight']} at once)"
               if r["bytes"] is not None else "not counted (no proxy)"))


def table(rows: list[dict]) -> str:
    lines = ["| loader | per | tp | rank | seconds | est. s | GB/s | CPU s | MB needed | MB fetched | x needed | "
             "requests | most in flight |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        secs = f"{r['seconds']:.2f}" if r["seconds"] is not None else ""
        est = f"{r['estimate']:.2f}" if r.get("estimate") is not None else ""
        rate = f"{r['needed'] / r['seconds'] / 1e9:.2f}" if r["seconds"] and r["needed"] else ""
        needed = f"{r['needed'] / 1e6:.1f}" if r["needed"] else ""
        ratio = f"{r['bytes'] / r['needed']:.2f}" if r["needed"] and r["bytes"] is not None else ""
        fetched = f"{r['bytes'] / 1e6:.1f}" if r["bytes"] is not None else ""
        cpu = f"{r['cpu_s']:.2f}" if r.get("cpu_s") is not None else ""
        lines.append(f"| {r['loader']} | {r['mode']} | {r['tp']} | {r['rank']} | {secs} | {est} | {rate} | {cpu} | "
                     f"{needed} | "
                     f"{fetched} | {ratio} | {r['requests'] or ''} | {r['in_flight'] or ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        print(json.dumps(_worker(json.loads(argv[1]))))
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.s3", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", help="a checkpoint directory (default: a generated one)")
    p.add_argument("--size-gb", type=float, default=0.3)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeat", type=int, default=1, help="rounds of the alternating loaders")
    p.add_argument("--extremes", action="store_true", help="also raylazy-exact and raylazy-whole, a rank alone")
    p.add_argument("--no-nodes", action="store_true", help="only ranks alone")
    p.add_argument("--no-alone", action="store_true", help="only nodes")
    p.add_argument("--first-byte-ms", type=float, default=0.0, help="the proxy waits this long before each answer")
    p.add_argument("--connection-mbps", type=float, default=0.0, help="MB/s each response is sent at (0: as fast as it can)")
    p.add_argument("--plan-before", default=None, help="an older checkout whose planning's requests to count too")
    p.add_argument("--no-proxy", action="store_true", help="every loader straight to SeaweedFS (nothing counted)")
    p.add_argument("--out", default=None, help="directory for the plans, results.json and results.md")
    args = p.parse_args(argv)
    if args.no_proxy and (args.first_byte_ms or args.connection_mbps or args.plan_before):
        p.error("--no-proxy: the proxy emulates the remote store and counts the planning's requests")
    model_dir = args.model_dir or ensure_checkpoint(ModelSpec(vocab=8000, size_gb=args.size_gb, shard_size="100MB"))
    out = args.out or tempfile.mkdtemp(prefix="raylazy-bench-s3-")
    os.makedirs(out, exist_ok=True)
    size = sum(os.path.getsize(f) for f in checkpoint_files(model_dir))
    print(f"checkpoint {model_dir}: {len(checkpoint_files(model_dir))} files, {size / 1e9:.2f} GB; results in {out}")
    rows = run(model_dir, args.tp, out, args.repeat, args.extremes, not args.no_nodes, not args.no_alone,
               args.first_byte_ms / 1e3,
               args.connection_mbps * 1e6, args.plan_before, not args.no_proxy)
    md = table(rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
