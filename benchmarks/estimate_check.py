"""Loads on this machine, measured per phase, for checking the load-time model (`raylazy.estimate`) against them.

    python -m benchmarks.estimate_check                        # measure, fit, rewrite tests/data/estimate_runs.json
    python -m benchmarks.estimate_check --raw /tmp/runs.json   # also keep the raw measurements (plans included)
    python -m benchmarks.estimate_check --from-raw /tmp/runs.json   # fit and rewrite from kept measurements
    python -m benchmarks.estimate_check --shapes               # only record the checkpoint's shapes anew

Every run is one `raylazy.load` with fresh actors, cold (local files evicted from the page cache, a fresh mount of
the emulated network file system, a fresh proxy count on SeaweedFS), on the CPU, from a ~0.5 GB Llama-shaped
checkpoint: local disk, the emulated NFS-like mount (`cached`) and uncached bucket mount (`direct`) of
benchmarks/netfs.py, and SeaweedFS behind benchmarks/s3server.py's proxy with a time to first byte; tp 1 to 8,
one to four simulated Ray nodes (`ray.cluster_utils.Cluster` on loopback: they share this machine's disk, page
cache and cores), replicas. Recorded per run: `LoadedModel.phases` (start, plan, ready, read, copy), the end-to-end
seconds and every rank's ReadStats and node. The runs marked `calibrate` fit this machine's hardware description
(`fit`); the model then predicts every run from its plan's figures (`raylazy.core.estimate.figures`) and that
description, and the data file keeps figures, measurements and the fitted hardware, and the checkpoint's shapes
(`shapes`: each file's safetensors header and size, the config's fields that shape tensors).
tests/core/test_estimate_check.py checks them again without loading anything: it plans every run anew from those
shapes (`recorded_checkpoint`, `run_plan`), takes the plan's figures as the run's were taken (`run_figures`),
finds them equal to those recorded and predicts from them. The shapes are read from the checkpoint the runs load
(built under the temporary directory if missing, in every mode); `--shapes` records them anew in the data file
and leaves the rest as it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "estimate_runs.json")

#: (name, storage, tp, simulated nodes, replicas, backend, role). Storage: local, nfs (the emulated NFS-like
#: mount), bucket (the emulated uncached bucket mount), s3 (SeaweedFS behind the proxy). Nodes: "1" (one node
#: of 8 CPUs) or the number of 2-CPU nodes the ranks are packed (PACK) or spread (SPREAD, one rank a node) on.
RUNS = (
    ("local-tp1", "local", 1, 1, 1, "auto", "calibrate"),
    ("local-tp4", "local", 4, 1, 1, "auto", "calibrate"),
    ("local-tp2", "local", 2, 1, 1, "auto", "validate"),
    ("local-tp8", "local", 8, 1, 1, "auto", "validate"),
    ("local-tp4-exchange", "local", 4, 1, 1, "exchange", "calibrate"),
    ("local-tp2-exchange", "local", 2, 1, 1, "exchange", "validate"),
    ("local-tp4-2nodes", "local", 4, 2, 1, "auto", "calibrate"),
    ("local-tp4-4nodes", "local", 4, 4, 1, "auto", "validate"),
    ("local-tp8-4nodes", "local", 8, 4, 1, "auto", "validate"),
    ("local-tp2-replicas2", "local", 2, 2, 2, "auto", "calibrate"),
    ("local-tp1-replicas4", "local", 1, 4, 4, "auto", "validate"),
    ("nfs-tp2", "nfs", 2, 1, 1, "auto", "calibrate"),
    ("nfs-tp4", "nfs", 4, 1, 1, "auto", "validate"),
    ("nfs-tp4-2nodes", "nfs", 4, 2, 1, "auto", "validate"),
    ("bucket-tp2", "bucket", 2, 1, 1, "auto", "calibrate"),
    ("bucket-tp4", "bucket", 4, 1, 1, "auto", "validate"),
    ("s3-tp2", "s3", 2, 1, 1, "auto", "calibrate"),
    ("s3-tp4", "s3", 4, 1, 1, "auto", "validate"),
    ("s3-tp4-2nodes", "s3", 4, 2, 1, "auto", "validate"),
)
#: The proxy's time to first byte in front of SeaweedFS (a remote store's wait, scaled down like the emulated
#: mounts' bandwidth).
S3_FIRST_BYTE_S = 0.010


def _cluster(nodes: int):
    """A loopback Ray cluster: one 8-CPU node, or four 2-CPU nodes (ranks packed two a node, or spread)."""
    from .harness.ray_clusters import start_cluster

    if nodes == 1:
        return start_cluster(dict(num_cpus=8, include_dashboard=False), [])
    return start_cluster(dict(num_cpus=2, include_dashboard=False), [dict(num_cpus=2)] * 3)


def _measure(model_dir: str, storage_options: dict | None, tp: int, nodes: int, replicas: int, backend: str) -> dict:
    import raylazy

    spread = nodes > 1 and nodes >= tp * replicas
    t = time.perf_counter()
    loaded = raylazy.load(model_dir, tp, replicas=replicas, backend=backend, device="cpu", use_gpu=False,
                          progress=False, storage_options=storage_options or {}, placement_timeout_s=120,
                          placement_strategy="SPREAD" if spread else "PACK")
    seconds = time.perf_counter() - t
    try:
        ids = [i.node_id for i in loaded.ranks]
        names = {n: f"node{k}" for k, n in enumerate(dict.fromkeys(ids))}
        ranks = [{"node": names[i], "backend": s.backend, "seconds": s.seconds, "bytes_read": s.bytes_read,
                  "bytes_needed": s.bytes_needed, "bytes_received": s.bytes_received,
                  "bytes_from_replica": s.bytes_from_replica, "requests": s.requests}
                 for i, s in zip(ids, loaded.stats)]
        return {"seconds": seconds, "phases": dict(loaded.phases), "ranks": ranks, "plan": loaded.plan.to_json()}
    finally:
        loaded.release()


def _cold(storage: str, model_dir: str, s3):
    """(model location, storage options, context to close) for one cold run on `storage`."""
    from contextlib import nullcontext

    from .loaders.checkpoint import checkpoint_files
    from .loaders.pagecache import evict
    from .netfs import PROFILES

    evict(checkpoint_files(model_dir))
    if storage == "local":
        return model_dir, None, nullcontext()
    if storage == "s3":
        s3.reset()
        return s3.uri, s3.storage_options, nullcontext()
    fs = PROFILES["emulated-nfs" if storage == "nfs" else "emulated-bucket"].mount(model_dir)
    return fs.mountpoint, None, fs


def _one(model_dir: str, s3, name: str, storage: str, tp: int, nodes: int, replicas: int, backend: str,
         role: str) -> dict:
    """One cold run of `RUNS`, recorded."""
    where, options, ctx = _cold(storage, model_dir, s3)
    with ctx:
        rec = _measure(where, options, tp, nodes, replicas, backend)
    return rec | dict(name=name, storage=storage, tp=tp, replicas=replicas, backend=backend, role=role,
                      load_average=os.getloadavg()[0])


def measure(model_dir: str, names: set[str] | None = None, repeat: int = 1, log=print) -> list[dict]:
    """Run `RUNS` (those named in `names`, or all) `repeat` times, cluster shape by cluster shape, the runs' order
    rotating between repeats; one record per run and repeat."""
    import ray

    from .harness.ray_clusters import stop_cluster
    from .s3server import S3Server

    runs = [r for r in RUNS if names is None or r[0] in names]
    s3 = None
    if any(r[1] == "s3" for r in runs):
        s3 = S3Server()
        s3.uri = s3.upload_dir(model_dir, "estimate", "model")
        s3.first_byte_s = S3_FIRST_BYTE_S
    records = []
    try:
        for shape in sorted({min(r[3], 2) for r in runs}):
            cluster = _cluster(shape)
            try:
                ray.init(address=cluster.address, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
                _measure(model_dir, None, 1, 1, 1, "auto")  # warm: worker processes, imports
                mine = [r for r in runs if min(r[3], 2) == shape]
                for rep in range(repeat):
                    for run in mine[rep % len(mine):] + mine[:rep % len(mine)]:
                        records.append(_one(model_dir, s3, *run))
                        log(f"{run[0]}: {records[-1]['seconds']:.2f} s "
                            + ", ".join(f"{k} {v:.2f}" for k, v in records[-1]["phases"].items()))
            finally:
                ray.shutdown()
                stop_cluster(cluster)
    finally:
        if s3 is not None:
            s3.close()
    return records


#: This machine's storages as the runs reach them: the figures the fit leaves alone (the emulators' settings:
#: latency per request, page cache, what raylazy keeps in flight) and the sources saying so. Local latency is the
#: page-fault/pread path, taken as nil beside the rates the fit finds.
STORAGES = {
    "local": dict(kind="local", latency_s=0.0, connections=64, request_bytes=16 << 20, page_cache=True),
    "nfs": dict(kind="fuse", latency_s=0.002, connections=16, request_bytes=4 << 20, page_cache=True),
    "bucket": dict(kind="fuse", latency_s=0.010, connections=16, request_bytes=4 << 20, page_cache=False),
    "s3": dict(kind="object", latency_s=S3_FIRST_BYTE_S, connections=32, request_bytes=8 << 20, page_cache=False),
}
FIXED_SOURCES = {
    "local": "this machine's virtual disk (ext4), read cold: the guest's page cache evicted before each run",
    "nfs": "benchmarks/netfs.py's emulated NFS-like mount (PROFILES['emulated-nfs']: 2 ms a request, pages cached; "
           "raylazy reads it as an unknown FUSE mount: 16 in flight, 4 MiB requests, raylazy.core.costs)",
    "bucket": "benchmarks/netfs.py's emulated uncached bucket mount (PROFILES['emulated-bucket']: 10 ms a request, "
              "direct_io; 16 in flight, 4 MiB requests, raylazy.core.costs)",
    "s3": f"SeaweedFS behind benchmarks/s3server.py's proxy, {S3_FIRST_BYTE_S * 1e3:g} ms to first byte; raylazy's "
          "object storage keeps 32 GETs of 8 MiB in flight a process (raylazy.storage.objects)",
}
NOTE = ("this machine, as python -m benchmarks.estimate_check fits it on cold loads: no GPU, simulated Ray nodes "
        "sharing its disk, page cache and cores; the exchange runs over gloo, replicas copy through Ray's object store")
#: The figures of this machine neither set by the emulators nor fitted.
MACHINE_SOURCES = {
    "storage.total_bps": "0: one machine, its reads limited by the storage's own figures",
    "node.gpus": "no GPU: the ranks load to the CPU", "node.cores": "os.cpu_count() of this machine",
    "node.host_to_device_bps": "no GPU: nothing moves host to device (a figure that never bounds)",
    "costs.plan_tensor_s": "one checkpoint's tensor count in every run: planning's cost per tensor is not separable here",
    "costs.shared_host": "simulated nodes (ray.cluster_utils.Cluster) on this one machine",
}
#: Figures the fit finds: shared by every storage (this machine's node and costs), or one per storage.
SHARED = ("costs.actor_start_s", "costs.actor_cpu_s", "costs.plan_s", "costs.plan_requests", "costs.read_setup_s", "costs.copy_setup_s",
          "node.memcpy_bps", "node.gpu_link_bps", "node.exchange_round_s", "node.nic_bps")
PER_STORAGE = ("storage.bandwidth_bps", "storage.connection_bps", "storage.latency_s")
START = {"costs.actor_start_s": 3.0, "costs.actor_cpu_s": 5.0, "costs.plan_s": 0.02, "costs.plan_requests": 2.0, "costs.read_setup_s": 0.2,
         "costs.copy_setup_s": 0.2, "node.memcpy_bps": 2e9, "node.gpu_link_bps": 1e9, "node.exchange_round_s": 0.001, "node.nic_bps": 1e9,
         "storage.bandwidth_bps": 1e9, "storage.connection_bps": 2e8}
#: A prediction is within the model's claim when it misses the measurement by at most this share or these seconds.
TOLERANCE, SLACK_S = 0.25, 0.1
PHASES = ("plan", "actors", "read", "copy", "total")


def measured_phases(rec: dict) -> dict[str, float]:
    """A run's measured phases as the model names them: actors = placement and start (`start` + `ready`)."""
    p = rec["phases"]
    return {"plan": p["plan"], "actors": p.get("start", 0.0) + p["ready"], "read": p.get("read", 0.0),
            "copy": p.get("copy", 0.0), "total": rec["seconds"]}


def _hardware(storage: str):
    """This machine's description of `storage` before the fit: its kind, requests and page cache, the fit's
    starting rates."""
    return machine({k: START[k] for k in SHARED}, _start(storage), storage)


def run_figures(plan, rec: dict):
    """The figures of `plan` loaded as recorded run `rec` was: on the nodes its ranks ran on, with its backend, on
    its storage."""
    from raylazy.core.estimate import figures

    return figures(plan, _hardware(rec["storage"]), backend=rec["backend"], node_ids=[r["node"] for r in rec["ranks"]])


def shapes(model_dir: str) -> dict:
    """What planning reads of the checkpoint at `model_dir`: each file's name, size and safetensors header (tensor
    names, dtypes, shapes, data offsets), and the fields of config.json that shape tensors."""
    from dataclasses import asdict

    from raylazy.storage import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    files = []
    for f in ckpt.files:
        with open(f.path, "rb") as fh:
            fh.seek(8)
            header = json.loads(fh.read(f.header_len))
        files.append({"name": os.path.basename(f.path), "file_size": f.file_size, "header_len": f.header_len,
                      "header": header})
    config = {k: v for k, v in asdict(ckpt.config).items() if v is not None}
    return {"root": os.path.basename(model_dir), "config": config, "files": files}


def recorded_checkpoint(recorded: dict):
    """The checkpoint of `recorded` (`shapes`), its headers parsed by raylazy's parser as if read from its files."""
    import struct

    from raylazy.core.checkpoint import Checkpoint, ModelConfig
    from raylazy.core.header import parse_header

    files = []
    for f in recorded["files"]:
        blob = json.dumps(f["header"], separators=(",", ":")).encode().ljust(f["header_len"])
        files.append(parse_header(struct.pack("<Q", len(blob)) + blob, f["file_size"], f["name"]))
    return Checkpoint(root=recorded["root"], files=tuple(files), config=ModelConfig.from_dict(recorded["config"]))


def run_plan(ckpt, rec: dict):
    """Recorded run `rec`'s plan made anew from checkpoint `ckpt` (`recorded_checkpoint`): its tp and replicas, for
    its storage as this machine's description has it (`raylazy plan --hardware`: the description's cost model
    chooses which row-split reads are gathered; local files: none). The loads' own cost models (the FUSE kind's
    figures, S3's measured on its first GETs) gather the same reads of this checkpoint."""
    from raylazy.core.mesh import Mesh
    from raylazy.core.options import PlanOptions
    from raylazy.core.planner import plan_checkpoint

    opts = PlanOptions(mesh=Mesh(tp=rec["tp"], dp=rec["replicas"]))
    return plan_checkpoint(ckpt, opts, None, _hardware(rec["storage"]).storage.cost_model())


def fitted(storage: str) -> tuple[str, ...]:
    """The figures of `storage` the fit finds: its rates, and the local disk's wait per request (the emulators' and
    the proxy's waits are their settings)."""
    return PER_STORAGE if storage == "local" else tuple(k for k in PER_STORAGE if k != "storage.latency_s")


def _start(storage: str) -> dict:
    """Where the fit starts a storage's own figures: its setting's latency, a guess of its rates."""
    return {k: START[k] for k in PER_STORAGE if k in START} | {"storage.latency_s": STORAGES[storage]["latency_s"]}


def machine(shared: dict, own: dict, storage: str, sources: dict | None = None):
    """This machine's Hardware on `storage` with the fitted figures."""
    from raylazy.core.hardware import hardware_from

    data = {"name": f"this machine ({storage})", "note": NOTE, "storage": dict(STORAGES[storage]),
            "node": dict(gpus=0, cores=os.cpu_count() or 2, host_to_device_bps=1e12), "costs": dict(shared_host=True),
            "sources": {**MACHINE_SOURCES, **(sources or {})}}
    for path, value in {**shared, **own}.items():
        group, key = path.split(".")
        data[group][key] = value
    return hardware_from(data)


def _error(predicted: float, measured: float) -> float:
    """How far outside the claim a prediction is (0: within max(25%, 0.1 s))."""
    return max(0.0, abs(predicted - measured) - max(TOLERANCE * measured, SLACK_S))


def fit(runs: list[dict]) -> tuple[dict, dict]:
    """The shared and per-storage figures that bring the model closest to the calibration runs (least squares of
    every phase's miss in units of what the claim allows it, max(25%, 0.1 s)), by coordinate search in steps of x3
    to x1.02: (shared, {storage: own})."""
    from raylazy.core.estimate import predict

    shared = {k: START[k] for k in SHARED}
    own = {s: _start(s) for s in {r["storage"] for r in runs}}

    def loss() -> float:  # each phase's miss in units of what the claim allows it
        total = 0.0
        for r in runs:
            est = predict(r["fig"], machine(shared, own[r["storage"]], r["storage"])).phases
            for ph, m in r["measured"].items():
                total += ((est[ph] - m) / max(TOLERANCE * m, SLACK_S)) ** 2
        return total

    best = loss()
    for step in (3.0, 1.5, 1.2, 1.05, 1.02):
        improved = True
        while improved:
            improved = False
            for table, key in [(shared, k) for k in SHARED] + [(own[s], k) for s in own for k in fitted(s)]:
                for factor in (step, 1 / step):
                    old = table[key]
                    table[key] = old * factor if old else 1e-4 * factor
                    new = loss()
                    if new < best - 1e-9:
                        best, improved = new, True
                    else:
                        table[key] = old
    return shared, own


def _median_run(recs: list[dict]) -> dict:
    """One run's repeats as one: each phase's median, and the repeat of the median total for its ranks and plan."""
    import statistics

    from raylazy.core.plans import Plan

    phases = [measured_phases(r) for r in recs]
    middle = sorted(recs, key=lambda r: r["seconds"])[len(recs) // 2]
    return {**middle, "fig": run_figures(Plan.from_json(middle["plan"]), middle), "repeats": phases,
            "measured": {ph: statistics.median(p[ph] for p in phases) for ph in PHASES}}


def check(records: list[dict], checkpoint: dict) -> dict:
    """Fit on the calibration runs, predict every run: the data file's content, with the `checkpoint`'s shapes."""
    from raylazy.core.estimate import predict

    runs = [_median_run([r for r in records if r["name"] == name]) for name in dict.fromkeys(r["name"] for r in records)]
    shared, own = fit([r for r in runs if r["role"] == "calibrate"])
    names = ", ".join(r["name"] for r in runs if r["role"] == "calibrate")
    out_runs, hardware = [], {}
    for storage in own:
        sources = {k: f"fitted on this machine by python -m benchmarks.estimate_check (calibration runs: {names}; "
                      f"{time.strftime('%Y-%m-%d')})" for k in (*SHARED, *fitted(storage))}
        sources.update({f"storage.{k}": FIXED_SOURCES[storage] for k in STORAGES[storage]
                        if f"storage.{k}" not in fitted(storage)})
        hardware[storage] = machine(shared, own[storage], storage, sources).model_dump()
    for r in runs:
        est = predict(r["fig"], hardware[r["storage"]])
        out_runs.append({k: r[k] for k in ("name", "role", "storage", "tp", "replicas", "backend", "load_average")}
                        | {"figures": r["fig"].to_dict(), "measured": r["measured"], "repeats": r["repeats"],
                           "predicted": est.phases,
                           "ranks": [{k: x[k] for k in ("node", "backend", "seconds", "bytes_read", "bytes_needed",
                                                        "bytes_received", "bytes_from_replica")} for x in r["ranks"]]})
    return {"command": "python -m benchmarks.estimate_check", "measured_on": time.strftime("%Y-%m-%d"),
            "tolerance": TOLERANCE, "slack_s": SLACK_S, "hardware": hardware, "runs": out_runs, "checkpoint": checkpoint}


def table(data: dict) -> str:
    """The docs' table: every run, predicted vs measured per phase, and whether each is within the claim."""
    head = "| run | role | " + " | ".join(f"{p} s (pred / meas)" for p in PHASES) + " | within |"
    lines = [head, "|" + " --- |" * (len(PHASES) + 3)]
    for r in data["runs"]:
        cells, misses = [], []
        for ph in PHASES:
            p, m = r["predicted"][ph], r["measured"][ph]
            cells.append(f"{p:.2f} / {m:.2f}")
            if _error(p, m):
                misses.append(ph)
        lines.append(f"| {r['name']} | {r['role']} | " + " | ".join(cells) + f" | {'yes' if not misses else 'no: ' + ', '.join(misses)} |")
    return "\n".join(lines)


def _preset(hardware: dict) -> None:
    """Keep this machine's fitted local-disk description as the `dev-2core` preset (package data)."""
    path = os.path.join(ROOT, "raylazy", "core", "hardware_presets.json")
    with open(path) as fh:
        table = json.load(fh)
    table["dev-2core"] = {k: v for k, v in hardware.items() if k != "name"}
    with open(path, "w") as fh:
        json.dump(table, fh, indent=2)
        fh.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.estimate_check", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", help="comma-separated run names (default: all)")
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each (median kept; default 3)")
    ap.add_argument("--raw", help="also write the raw measurements (plans included) here")
    ap.add_argument("--from-raw", help="fit and rewrite from these raw measurements instead of measuring")
    ap.add_argument("--shapes", action="store_true",
                    help="only record the checkpoint's shapes anew in --out (its runs as they are); nothing measured")
    ap.add_argument("--out", default=DATA)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from .loaders.checkpoint import ModelSpec, ensure_checkpoint

    model_dir = ensure_checkpoint(ModelSpec(size_gb=args.size_gb, shard_size="200MB"),
                                  os.path.join(tempfile.gettempdir(), "raylazy-estimate-check"))
    if args.shapes:
        with open(args.out) as fh:
            data = json.load(fh) | {"checkpoint": shapes(model_dir)}
    else:
        if args.from_raw:
            with open(args.from_raw) as fh:
                records = json.load(fh)
        else:
            records = measure(model_dir, set(args.runs.split(",")) if args.runs else None, args.repeat)
            if args.raw:
                with open(args.raw, "w") as fh:
                    json.dump(records, fh)
        data = check(records, shapes(model_dir))
        _preset(data["hardware"]["local"])
        print(table(data))
    with open(args.out, "w") as fh:
        json.dump(data, fh, indent=1)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
