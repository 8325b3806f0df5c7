"""How a raylazy load drives the Ray autoscaler: nodes come up, ranks are placed, start, read, finish.

    python examples/autoscaling_experiment.py [MODEL_DIR] [--tp 4] [--gpus-per-node 2] [--max-workers 2]
                                              [--timeout 300] [--out DIR]

Starts a local Ray head with Ray's fake multi-node autoscaler (worker nodes are extra raylets on
this machine, each advertising `--gpus-per-node` *logical* GPUs), with no worker nodes. Then
`raylazy.load(model_dir, tp, use_gpu=True, device="cpu")` asks for a placement group of `tp`
bundles of one GPU each: the autoscaler adds nodes until it fits, the rank actors start on them and
read their byte ranges (to the CPU: the GPUs are pretend). A background thread polls `ray.nodes()`
and the placement group table; each rank actor records when it started, was ready (torch
imported) and read. Prints a table and writes `timeline.json` and `timeline.png` to `--out`.

Second phase (when the cluster can hold two replicas: 2 x tp <= max_workers x gpus_per_node): with the
first replica loaded from storage, `raylazy.load(source=loaded, ...)` asks for a second replica; the autoscaler
adds nodes for it and its ranks copy their shards from the live replica's ranks instead of storage. The
timeline, the table and the PNG show both phases: node start, actor start, bytes from storage, bytes from
peers, seconds.

vLLM phase (with `--vllm-python`, the vLLM virtualenv's python: docs/vllm.md): the checkpoint is held in the
cluster's object store (`raylazy.hold`: read from storage once), then `--engines` vLLM engines (the CPU build) start
one after another on this machine, each joining the cluster (RAY_ADDRESS) and loading with `load_format="raylazy"`:
each takes the checkpoint from the holder, reading only headers from storage (its workers' `rchar`). The timeline
adds the holder's fill and each engine's start to its first token, with its load step, the tensor bytes it read from
storage (`storage B`: none, taken from the holder) and its workers' read calls meanwhile (`rchar`: the headers, and
Ray's own socket reads, which /proc counts alike).

When the cluster can never hold the request (tp > max_workers x gpus_per_node), the load fails with
raylazy's `PlacementError` after `--timeout` seconds (its `placement_timeout_s`): the script prints
it and exits with status 2. The cluster is torn down in every case: only the processes it started
(found by its own --temp-dir) are killed, never other Ray clusters on the machine.

Linux only (the fake provider runs every node on this machine). Needs `ray[default]` and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import raylazy
from raylazy.cluster.actor import RankLoader

#: This checkout, on the vLLM engines' PYTHONPATH (their virtualenv need not have raylazy installed from it).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---------------------------------------------------------------- the fake autoscaling cluster


def _free_port(preferred: int | None = None) -> int:
    with socket.socket() as s:
        try:
            s.bind(("", preferred or 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


class FakeCluster:
    """A Ray head with the fake multi-node autoscaler, on loopback, in its own temp dir and ports."""

    def __init__(self, gpus_per_node: int, max_workers: int, cpus_per_node: int = 2, head_cpus: int = 1,
                 idle_timeout_minutes: float = 5.0):
        self.temp_dir = tempfile.mkdtemp(prefix="rlfake", dir="/tmp")  # short: Unix socket paths live under it
        self.port = _free_port(6379)  # the fake provider's default GCS port; any other is passed to it
        self.address = f"127.0.0.1:{self.port}"
        self.config = {
            "cluster_name": "raylazy-fake",
            "max_workers": max_workers,
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_timeout_minutes,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": self.address},
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
                "gpu_node": {
                    "resources": {"CPU": cpus_per_node, "GPU": gpus_per_node, "object_store_memory": 100 * 2**20},
                    "node_config": {}, "min_workers": 0, "max_workers": max_workers,
                },
            },
            "head_node_type": "ray.head.default",
            "docker": {}, "auth": {}, "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }
        self.head_cpus = head_cpus

    def env(self) -> dict:
        return {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every node (and the fake ones) on 127.0.0.1
                "RAY_USAGE_STATS_ENABLED": "0"}

    def start(self) -> str:
        config_path = os.path.join(self.temp_dir, "autoscaling.yaml")
        with open(config_path, "w") as fh:
            json.dump(self.config, fh, indent=2)  # JSON is YAML
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--head", f"--temp-dir={self.temp_dir}",
               f"--port={self.port}", "--node-ip-address=127.0.0.1", f"--autoscaling-config={config_path}",
               f"--num-cpus={self.head_cpus}", "--num-gpus=0", "--object-store-memory=100000000",
               "--include-dashboard=false", f"--ray-client-server-port={_free_port()}",
               f"--dashboard-agent-listen-port={_free_port()}", "--disable-usage-stats"]
        try:
            out = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=180)
            if out.returncode != 0:
                raise RuntimeError(f"ray start failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        except BaseException:
            self.stop()
            raise
        return self.address

    def stop(self) -> int:
        """Kill this cluster's processes (those naming its temp dir, and their descendants); returns how many."""
        pids = cluster_pids(self.temp_dir)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids):
            time.sleep(0.1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return len(pids)


def cluster_pids(tag: str) -> list[int]:
    """Processes whose command line contains `tag`, and all their descendants (from /proc), not this one."""
    parent, cmdline = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parent[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline[int(entry)] = fh.read().decode(errors="replace")
        except OSError:
            continue
    found = {pid for pid, cmd in cmdline.items() if tag in cmd}
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(found)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    found.discard(os.getpid())
    return sorted(found)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ---------------------------------------------------------------- what is recorded


class TimedRankLoader(RankLoader):
    """raylazy's rank actor, also recording (wall-clock) when it started, was ready, and read."""

    def __init__(self, rank: int, device: str = "auto"):
        self.started_at = time.time()  # the actor's process runs: its bundle was placed
        super().__init__(rank, device)
        self.ready_at = time.time()    # torch imported, device resolved
        self.read_span = (None, None)

    def load(self, plan, options, node_read=None):
        start = time.time()
        stats = super().load(plan, options, node_read)
        self.read_span = (start, time.time())
        return stats

    def receive(self, source, plan, options, transport="object_store", in_place=False):
        start = time.time()
        stats = super().receive(source, plan, options, transport, in_place)
        self.read_span = (start, time.time())
        return stats

    def times(self) -> dict:
        return {"started": self.started_at, "ready": self.ready_at, "read_start": self.read_span[0],
                "read_end": self.read_span[1]}


class Watcher(threading.Thread):
    """Polls ray.nodes() and the placement group table: when each node appeared, when raylazy's group was placed."""

    def __init__(self, interval_s: float = 0.2):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.nodes: dict[str, dict] = {}
        self.pg_placed_at: float | None = None
        self._halt = threading.Event()

    def poll(self) -> None:
        import ray

        now = time.time()
        # The placement groups first, then the nodes: a group placed by now is on nodes the listing after it
        # holds, so a node is never seen a poll later than the group placed on it (a node that registered
        # between the two listings, the other way round, once was).
        if self.pg_placed_at is None:
            for pg in ray.util.placement_group_table().values():
                if str(pg.get("name", "")).startswith("raylazy-") and pg.get("state") == "CREATED":
                    self.pg_placed_at = now
        for n in ray.nodes():
            if n["Alive"] and n["NodeID"] not in self.nodes:
                res = n["Resources"]
                self.nodes[n["NodeID"]] = {"node_id": n["NodeID"], "seen_at": now, "gpus": res.get("GPU", 0),
                                           "cpus": res.get("CPU", 0), "head": "node:__internal_head__" in res}

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001  (the cluster is going away)
                pass
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


# ---------------------------------------------------------------- the experiment


def _rank_rows(loaded, t0: float) -> list[dict]:
    """Per rank: where it ran, what it read from storage and copied from a peer, and when (seconds from t0)."""
    import ray

    rows = []
    for info, st, tm in zip(loaded.ranks, loaded.stats, ray.get([a.times.remote() for a in loaded.actors])):
        rows.append({"rank": info.rank, "node_id": info.node_id, "pid": info.pid, "gpu_ids": list(info.gpu_ids),
                     "device": info.device, "bytes_read": st.bytes_read, "bytes_from_replica": st.bytes_from_replica,
                     "read_seconds": st.seconds, **{k: (v - t0 if v is not None else None) for k, v in tm.items()}})
    return rows


def run_experiment(args, model_dir: str, cluster: FakeCluster) -> dict:
    import ray

    from raylazy.errors import RaylazyError

    if TimedRankLoader.__module__ != "__main__":  # imported: ship the class by value, the workers cannot import us
        ray.cloudpickle.register_pickle_by_value(sys.modules[TimedRankLoader.__module__])
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    watcher = Watcher()
    watcher.poll()  # the nodes present before the load (the head)
    watcher.start()
    t0 = time.time()
    result = {"t0": t0, "tp": args.tp, "gpus_per_node": args.gpus_per_node, "max_workers": args.max_workers,
              "timeout_s": args.timeout, "error": None, "ranks": [], "replica": None}
    loaded = replica = None
    try:
        loaded = raylazy.load(model_dir, tp=args.tp, use_gpu=True, device="cpu", progress=False,
                              placement_timeout_s=args.timeout, actor_cls=TimedRankLoader)
        result["load_seconds"] = time.time() - t0
        result["ranks"] = _rank_rows(loaded, t0)
        result["summary"] = loaded.summary()
        if 2 * args.tp <= args.max_workers * args.gpus_per_node:  # room for a second replica: copy it from the first
            t1 = time.time()
            replica = raylazy.load(source=loaded, use_gpu=True, device="cpu", progress=False,
                                   placement_timeout_s=args.timeout, actor_cls=TimedRankLoader)
            result["replica"] = {"start": t1 - t0, "load_seconds": time.time() - t1, "ranks": _rank_rows(replica, t0),
                                 "summary": replica.summary()}
        if args.vllm_python:
            result["vllm"] = vllm_phase(args, model_dir, cluster, t0)
            result["error"] = result["vllm"].get("error")
    except RaylazyError as e:  # PlacementError when the cluster cannot hold tp GPUs within --timeout
        result["load_seconds"] = result.get("load_seconds", time.time() - t0)
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        for m in (replica, loaded):
            if m is not None:
                m.release()
        watcher.poll()
        watcher.stop()
        ray.shutdown()
    result["pg_placed"] = watcher.pg_placed_at - t0 if watcher.pg_placed_at else None
    nodes = sorted(watcher.nodes.values(), key=lambda n: n["seen_at"])
    result["nodes"] = [{**n, "seen_at": n["seen_at"] - t0} for n in nodes]
    for r in result["ranks"] + (result["replica"] or {}).get("ranks", []):
        r["node_added"] = next((n["seen_at"] for n in result["nodes"] if n["node_id"] == r["node_id"]), None)
    return result


#: One vLLM engine, run by the vLLM virtualenv's python: its start (before vLLM is imported) and its first token.
ENGINE = r"""
import json, sys, time
t0 = time.time()
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], load_format="raylazy", dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
          max_model_len=128, max_num_seqs=1)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
print("ENGINE " + json.dumps({"start": t0, "ready": time.time()}), flush=True)
llm.llm_engine.engine_core.shutdown()
"""


def vllm_phase(args, model_dir: str, cluster: FakeCluster, t0: float) -> dict:
    """The checkpoint held, then `args.engines` vLLM engines one after another, each taking it from the holder:
    when each started and was ready (seconds from t0), how its worker loaded and what it read from storage; an
    engine that fails ends the phase (`error`)."""
    import ray

    from raylazy.io.report import fields

    start = time.time()
    held = raylazy.hold(model_dir)
    out = {"hold": {"start": start - t0, "end": time.time() - t0, "fill_s": max(i.seconds for i in held.infos()),
                    "bytes": max(i.nbytes for i in held.infos()), "nodes": len(held.actors)}, "engines": []}
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=REPO,
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    try:
        for i in range(args.engines):
            done = subprocess.run([args.vllm_python, "-c", ENGINE, model_dir], env=env, capture_output=True,
                                  text=True, timeout=600)
            times = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("ENGINE ")), None)
            lines = [f for f in map(fields, (done.stdout + done.stderr).splitlines()) if f]
            if times is None or not lines:  # the engine's own error, its last lines
                out["error"] = f"vLLM engine {i + 1} failed: {(done.stdout + done.stderr)[-2000:]}"
                break
            out["engines"].append({"engine": i + 1, "start": times["start"] - t0, "ready": times["ready"] - t0,
                                   "storage": lines[0]["storage"], "mode": lines[0]["mode"],
                                   "step_s": max(f["seconds"] for f in lines),
                                   "planned": sum(f["planned_bytes_read"] for f in lines),
                                   "rchar": sum(f["rchar"] or 0 for f in lines)})
    finally:
        held.release()
    return out


def report(result: dict) -> str:
    def t(x):
        return f"{x:8.2f}" if x is not None else f"{'-':>8}"

    lines = [f"timeline, seconds from the raylazy.load call (tp={result['tp']}, {result['gpus_per_node']} GPU(s) "
             f"per node, at most {result['max_workers']} worker node(s))", "nodes:"]
    for n in result["nodes"]:
        kind = "head (present before the load)" if n["head"] else f"worker, {n['gpus']:g} GPU(s)"
        lines.append(f"  {t(n['seen_at'] if n['seen_at'] > 0 else 0.0)}  {n['node_id'][-12:]}  {kind}")
    lines.append(f"placement group placed at {t(result['pg_placed']).strip()}")
    phases = [("first replica, from storage", result["ranks"], result.get("load_seconds"))]
    if result["replica"]:
        rep = result["replica"]
        phases.append((f"second replica, from the live one (asked at {rep['start']:.2f})", rep["ranks"],
                       rep["load_seconds"]))
    for title, ranks, seconds in phases if result["ranks"] else ():
        lines.append(f"{title}:")
        lines.append(f"{'rank':>4} {'node':>12} {'node added':>10} {'started':>8} {'ready':>8} {'read from':>9} "
                     f"{'read to':>8} {'read s':>7} {'storage B':>10} {'peers B':>10}")
        for r in ranks:
            lines.append(f"{r['rank']:>4} {r['node_id'][-12:]:>12} {t(r['node_added']):>10} {t(r['started'])} "
                         f"{t(r['ready'])} {t(r['read_start']):>9} {t(r['read_end'])} {r['read_seconds']:7.3f} "
                         f"{r['bytes_read']:>10} {r['bytes_from_replica']:>10}")
        lines.append(f"total load time {seconds:.2f} s")
    if result.get("vllm"):
        v = result["vllm"]
        lines.append(f"vLLM engines: the checkpoint held on {v['hold']['nodes']} node(s) from {t(v['hold']['start'])} "
                     f"to {t(v['hold']['end'])} ({v['hold']['bytes']} bytes read from storage in "
                     f"{v['hold']['fill_s']:.2f} s), then one engine after another:")
        lines.append(f"{'engine':>6} {'started':>8} {'ready':>8} {'step s':>7} {'from':>8} {'storage B':>10} "
                     f"{'rchar':>10}")
        for e in v["engines"]:
            lines.append(f"{e['engine']:>6} {t(e['start'])} {t(e['ready'])} {e['step_s']:7.3f} {e['storage']:>8} "
                         f"{e['planned']:>10} {e['rchar']:>10}")
    if result.get("vllm", {}).get("error"):
        lines.append(result["vllm"]["error"])
    elif result["error"]:
        lines.append(f"load failed after {result['load_seconds']:.1f} s: {result['error']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    second = (result["replica"] or {}).get("ranks", [])
    engines = (result.get("vllm") or {}).get("engines", [])
    end = max([result["load_seconds"]] + [r["read_end"] for r in result["ranks"] + second] +
              [e["ready"] for e in engines])
    workers = [n for n in result["nodes"] if not n["head"]]
    lanes = [(f"node …{n['node_id'][-5:]}", n) for n in workers]
    lanes += [(f"rank {r['rank']} (node …{r['node_id'][-5:]})", r) for r in result["ranks"]]
    lanes += [(f"replica 2 rank {r['rank']} (node …{r['node_id'][-5:]})", {**r, "peer": True}) for r in second]
    if engines:
        lanes += [("holder", result["vllm"]["hold"])] + [(f"vLLM engine {e['engine']}", e) for e in engines]
    labelled = set()
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(lanes) + 1.6))
    for y, (_, item) in enumerate(lanes):
        if "rank" in item:
            peer = item.get("peer", False)
            mb = (item["bytes_from_replica"] if peer else item["bytes_read"]) / 1e6
            how = (("copying from the live replica", "tab:purple") if peer else ("reading its ranges from storage", "tab:green"))
            for label, color, span in (("actor start (imports torch)", "tab:orange", (item["started"], item["ready"] - item["started"])),
                                       (*how, (item["read_start"], max(item["read_end"] - item["read_start"], end / 400)))):
                ax.broken_barh([span], (y - 0.3, 0.6), color=color, label=None if label in labelled else label)
                labelled.add(label)
            ax.text(item["read_end"] + end / 200, y, f"{mb:.1f} MB {'from peers' if peer else 'from storage'}",
                    va="center", fontsize="x-small")
        elif "engine" in item:
            ax.broken_barh([(item["start"], item["ready"] - item["start"])], (y - 0.3, 0.6), color="tab:cyan",
                           label=None if "engine" in labelled else "vLLM engine: start to first token")
            labelled.add("engine")
            ax.text(item["ready"] + end / 200, y, f"{item['planned'] / 1e6:.1f} MB from storage, step "
                    f"{item['step_s']:.2f} s from the {item['storage']}", va="center", fontsize="x-small")
        elif "fill_s" in item:
            ax.broken_barh([(item["start"], item["end"] - item["start"])], (y - 0.3, 0.6), color="tab:olive",
                           label="raylazy.hold: the checkpoint read once")
            ax.text(item["end"] + end / 200, y, f"{item['bytes'] / 1e6:.1f} MB from storage", va="center",
                    fontsize="x-small")
        else:
            ax.broken_barh([(max(item["seen_at"], 0), end - max(item["seen_at"], 0))], (y - 0.15, 0.3),
                           color="tab:blue", label="worker node up" if y == 0 else None)
    if result["pg_placed"] is not None:
        ax.axvline(result["pg_placed"], color="k", ls="--", lw=1, label="placement group placed")
    ax.axvline(result["load_seconds"], color="tab:red", lw=1,
               label="load returned" if not result["error"] else result["error"].split(":")[0])
    if result["replica"]:
        ax.axvline(result["replica"]["start"], color="tab:purple", ls=":", lw=1, label="second replica asked for")
    ax.set_yticks(range(len(lanes)), [name for name, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.15)
    ax.set_xlabel("seconds from the raylazy.load call")
    ax.set_title(f"raylazy tp={result['tp']} on the fake autoscaler ({result['gpus_per_node']} GPU/node)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="model directory (default: generate a small Llama-shaped one)")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel size: GPUs the load asks for (default 4)")
    ap.add_argument("--gpus-per-node", type=int, default=2, help="logical GPUs per fake worker node (default 2)")
    ap.add_argument("--max-workers", type=int, default=2, help="most worker nodes the autoscaler may add (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds to wait for the placement (raylazy's placement_timeout_s; default 300)")
    ap.add_argument("--vllm-python", help="the vLLM virtualenv's python: after the loads, hold the checkpoint and "
                    "start --engines vLLM engines that take it from the holder")
    ap.add_argument("--engines", type=int, default=3, help="vLLM engines of the vLLM phase (default 3)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "raylazy-autoscaling"),
                    help="directory for timeline.json and timeline.png (default: raylazy-autoscaling in the temp dir)")
    args = ap.parse_args(argv)

    capacity = args.max_workers * args.gpus_per_node
    if args.tp > capacity:
        print(f"note: tp={args.tp} needs {args.tp} GPUs but this cluster can never have more than {capacity} "
              f"(--max-workers {args.max_workers} x --gpus-per-node {args.gpus_per_node}): expect a "
              f"PlacementError after {args.timeout:g} s", flush=True)
    # Before Ray is imported: this driver, like the cluster, stays on 127.0.0.1 (else Ray resolves
    # 127.0.0.1 to the machine's address, where the loopback-only GCS does not listen) ...
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # ... and uses `ray start`'s token authentication.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_cli if os.path.exists(ray_cli) else "ray", "get-auth-token", "--generate"],
                   capture_output=True, check=True)  # creates ~/.ray/auth_token if there is none

    # SIGTERM (a CI timeout) still tears the cluster down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="raylazy-autoscale-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from raylazy.synthetic import write_llama_checkpoint

            model_dir = write_llama_checkpoint(tmp)
            print(f"no model given: generated a Llama-shaped checkpoint in {model_dir}", flush=True)
        cluster = FakeCluster(args.gpus_per_node, args.max_workers)
        print(f"starting a fake autoscaling cluster at {cluster.address} (temp dir {cluster.temp_dir}), "
              "no worker nodes", flush=True)
        started = time.time()
        try:
            cluster.start()
            print(f"head up in {time.time() - started:.1f} s; loading with tp={args.tp}, use_gpu=True, "
                  "device='cpu'", flush=True)
            result = run_experiment(args, model_dir, cluster)
        finally:
            killed = cluster.stop()
            print(f"fake cluster torn down ({killed} processes)", flush=True)

    print(report(result))
    with open(os.path.join(args.out, "timeline.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    plot(result, os.path.join(args.out, "timeline.png"))
    print(f"wrote {os.path.join(args.out, 'timeline.json')} and {os.path.join(args.out, 'timeline.png')}")
    if result["error"]:
        print(f"error: {result['error']}", file=sys.stderr)
        return 2
    print(result["summary"])
    if result["replica"]:
        print(result["replica"]["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
