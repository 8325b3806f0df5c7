"""Running one measured load: rank processes for the process loaders, `raylazy.load` for raylazy.

Both return a record: per-rank measurements taken inside the rank (impls.measured:
wall, CPU, /proc/self/io deltas, exact peak RSS) plus memory peaks sampled from
outside (`Sampler`: /proc/PID/status every 25 ms, psutil USS round-robin).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

from raylazy.io.stats import proc_io

from . import impls
from .diskstats import Reads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Sampler:
    """Peak RSS / anonymous RSS (every `interval`) and USS (psutil, one pid per `uss_interval`) of some pids."""

    def __init__(self, pids_fn, interval: float = 0.025, uss_interval: float = 0.1):
        self.pids_fn, self.interval, self.uss_interval = pids_fn, interval, uss_interval
        self.peaks: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-sampler")

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> dict[int, dict]:
        self._stop.set()
        self._thread.join()
        return self.peaks

    def _loop(self) -> None:
        import psutil

        rr, next_uss = 0, 0.0
        while True:
            pids = list(self.pids_fn())
            now = time.monotonic()
            for pid in pids:
                try:
                    st = impls.proc_status(pid)
                except (OSError, ValueError):
                    continue
                p = self.peaks.setdefault(pid, {"rss": 0, "anon": 0, "uss": 0, "samples": 0, "uss_samples": 0})
                p["rss"] = max(p["rss"], st.get("VmRSS", 0))
                p["anon"] = max(p["anon"], st.get("RssAnon", 0))
                p["samples"] += 1
            if pids and now >= next_uss:
                pid = pids[rr % len(pids)]
                rr += 1
                next_uss = now + self.uss_interval
                try:
                    uss = psutil.Process(pid).memory_full_info().uss
                    p = self.peaks.setdefault(pid, {"rss": 0, "anon": 0, "uss": 0, "samples": 0, "uss_samples": 0})
                    p["uss"] = max(p["uss"], uss)
                    p["uss_samples"] += 1
                except (psutil.Error, OSError):
                    pass
            if self._stop.wait(self.interval):
                return


class WorkerError(RuntimeError):
    pass


class ProcessRanks:
    """`tp` rank processes of one process loader, started once and told to run as often as needed."""

    def __init__(self, loader: str, plan_path: str, tp: int, model_dir: str, log_dir: str):
        self.loader, self.tp = loader, tp
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
        self.procs, self.msgs, self.logs = [], [], []
        for r in range(tp):
            rfd, wfd = os.pipe()
            log_path = os.path.join(log_dir, f"{loader}-tp{tp}-rank{r}.log")
            log = open(log_path, "ab")
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.loaders.worker", loader, plan_path, str(r), model_dir, str(wfd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(wfd,), cwd=ROOT, env=env,
                text=True, bufsize=1,
            )
            os.close(wfd)
            log.close()
            self.procs.append(proc)
            self.msgs.append(os.fdopen(rfd, "r"))
            self.logs.append(log_path)
        self.pids: list[int] = []

    def wait_ready(self) -> ProcessRanks:
        """Wait until every rank process has imported its libraries (start several groups, then wait)."""
        if not self.pids:
            self.pids = [self._read(r)["ready"] for r in range(self.tp)]
        return self

    def _read(self, r: int) -> dict:
        line = self.msgs[r].readline()
        if not line:
            tail = open(self.logs[r], errors="replace").read()[-3000:]
            raise WorkerError(f"{self.loader} rank {r} exited (rc {self.procs[r].poll()}); log tail:\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            raise WorkerError(f"{self.loader} rank {r}: {msg['error']}\n{msg.get('traceback', '')}")
        return msg

    def send(self, ranks: list[int], cmd: str) -> list[dict]:
        for r in ranks:
            self.procs[r].stdin.write(cmd + "\n")
            self.procs[r].stdin.flush()
        return [self._read(r) for r in ranks]

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("exit\n")
                p.stdin.close()
            except OSError:
                pass
        for p, m in zip(self.procs, self.msgs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            m.close()


def node_reads(disk, ranks: list[dict]):
    """What `disk` served from the first rank's start (its "disk_start") until now, once no read is in flight.

    The window is the ranks' loading, so actor start-up and other processes' reads around it stay out.
    """
    starts = [m["disk_start"] for m in ranks if m.get("disk_start")]
    if disk is None or not starts:
        return None
    first = Reads(**{k: min(s[k] for s in starts) for k in starts[0]})  # the counters only grow
    return disk.settled_reads() - first


def run_process(group: ProcessRanks, ranks: list[int], verify: bool, disk=None) -> dict:
    """`ranks` of `group` load at once; `disk` (a diskstats.Device): the node's reads while they did, in "disk"."""
    sampler = Sampler(lambda: [group.pids[r] for r in ranks]).start()
    try:
        replies = group.send(ranks, "run")
        dev = node_reads(disk, replies)
    finally:
        peaks = sampler.stop()
    checks = None
    if verify:
        checks = {r: m["checksums"] for r, m in zip(ranks, group.send(ranks, "verify"))}
    group.send(ranks, "free")
    for m in replies:
        m.update({f"sampled_{k}": v for k, v in peaks.get(m["pid"], {}).items()})
    return {"ranks": replies, "checksums": checks, "disk": dev, "driver_read_bytes": 0}


# --- raylazy through raylazy.load ----------------------------------------------------------------


def init_ray(num_cpus: int) -> bool:
    """Start a local Ray of our own (True), or use the one this process already joined (False)."""
    import ray
    from ray import cloudpickle

    import benchmarks

    # The actor class and the checksum function travel by value: workers of a cluster started
    # elsewhere (a test session's) need not be able to import `benchmarks`.
    cloudpickle.register_pickle_by_value(benchmarks)
    logging.getLogger("raylazy").addHandler(logging.NullHandler())  # no summary line per load
    logging.getLogger("raylazy").setLevel(logging.WARNING)
    if ray.is_initialized():
        return False
    from raylazy.cluster.bundles import worker_config

    # the workers import torch as they start, as in the local Ray raylazy.load starts itself
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
             object_store_memory=256 << 20, log_to_driver=False, _system_config=worker_config(num_cpus))
    return True


def run_raylazy(model_dir: str, tp: int, options: dict, active: list[int] | None, verify: bool, disk=None) -> dict:
    """One raylazy.load(model_dir, tp, device="cpu", **options); `active` ranks read (None: all), the others'
    actors start but sit the load out. `disk`: the node's reads while the ranks loaded, in "disk"; the
    driver's own (its planning reads the headers) in "driver_read_bytes"."""
    import psutil
    import ray

    import raylazy

    from .rayactor import configured, shard_checksums

    pid_dir = tempfile.mkdtemp(prefix="raylazy-bench-pids-")
    want = set(range(tp) if active is None else active)

    def pids():
        out = []
        for name in os.listdir(pid_dir):
            if int(name) in want:
                try:
                    out.append(int(open(os.path.join(pid_dir, name)).read()))
                except (OSError, ValueError):
                    pass
        return out

    sampler = Sampler(pids).start()
    io0 = proc_io()["read_bytes"]
    cpu0, t0 = time.process_time(), time.monotonic()
    try:
        loaded = raylazy.load(model_dir, tp, device="cpu", use_gpu=False, progress=False,
                              actor_cls=configured(active, pid_dir), **options)
    finally:
        e2e = time.monotonic() - t0
        driver_cpu = time.process_time() - cpu0
        driver_read = proc_io()["read_bytes"] - io0  # planning: the headers, before the ranks start
        peaks = sampler.stop()
    try:
        ranks = []
        for s in loaded.stats:
            m = s.bench
            if m is None:
                continue
            m = dict(m, reader_seconds=s.seconds, staging_bytes=s.staging_bytes, requests=s.requests)
            m.update({f"sampled_{k}": v for k, v in peaks.get(m["pid"], {}).items()})
            ranks.append(m)
        dev = node_reads(disk, ranks)
        actor_cpu = 0.0
        for info in loaded.ranks:
            try:
                c = psutil.Process(info.pid).cpu_times()
                actor_cpu += c.user + c.system
            except psutil.Error:
                pass
        checks = None
        if verify:
            ranks_read = sorted(want)
            refs = [loaded.actors[r].run.remote(shard_checksums) for r in ranks_read]
            checks = dict(zip(ranks_read, ray.get(refs)))
        actor_pids = [i.pid for i in loaded.ranks]
    finally:
        loaded.release()
    _wait_gone(actor_pids)
    for name in os.listdir(pid_dir):
        os.unlink(os.path.join(pid_dir, name))
    os.rmdir(pid_dir)
    return {"ranks": ranks, "checksums": checks, "e2e_s": e2e, "e2e_cpu_s": driver_cpu + actor_cpu, "disk": dev,
            "driver_read_bytes": driver_read}


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> None:
    import psutil

    deadline = time.monotonic() + timeout_s
    for pid in pids:
        try:
            psutil.Process(pid).wait(timeout=max(0.1, deadline - time.monotonic()))
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            pass


# --- reference --------------------------------------------------------------------------------


def reference_checksums(plan, files: list[str], cache_path: str | None = None) -> dict[int, dict[str, str]]:
    """rank -> {name: checksum} of the shards as the plan defines them, cut from safetensors' get_tensor."""
    import torch
    from safetensors import safe_open

    if cache_path and os.path.isfile(cache_path):
        with open(cache_path) as fh:
            return {int(k): v for k, v in json.load(fh).items()}
    want = [{t.name: t for t in rp.tensors} for rp in plan.ranks]
    out: dict[int, dict[str, str]] = {r: {} for r in range(plan.tp)}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                full = None
                for r in range(plan.tp):
                    if name in want[r]:
                        full = f.get_tensor(name) if full is None else full
                        out[r].update(impls.checksums({name: impls.cut(torch, full, want[r][name], owned=False)}))
    if cache_path:
        with open(cache_path, "w") as fh:
            json.dump(out, fh)
    return out
