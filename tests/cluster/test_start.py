"""A load's start: the Ray raylazy starts itself has its workers import torch and raylazy's readers as they start
(`raylazy.cluster.bundles.PRELOAD`) and no dashboard, the driver imports no torch to start the ranks, and a load's
end-to-end seconds split into its steps (`LoadedModel.phases`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import raylazy
from tests.support import REPO

#: Run in a process of its own (its own local Ray, started by raylazy): what a fresh worker has imported before
#: running anything (the function is pickled by value: the worker imports nothing of this script's); whether two
#: ranks reserving every CPU take the workers Ray started ahead (Ray's default ends idle workers beyond the CPUs
#: left free); whether the driver imported torch to start them (Ray's tensor transports would, registered at
#: the actors' creation); and whether Ray's dashboard runs (it should not: `ensure_ray`).
PROBE = """
import json, sys, time, psutil, ray
from raylazy.cluster.bundles import ensure_ray
from raylazy.cluster.group import Deadline, RankGroup

def imported():
    import sys
    return {m: m in sys.modules for m in ("torch", "raylazy.io.backends")}

def dashboard():  # Ray starts its dashboard's process either way, without its front end or its modules when told
    return any("dashboard.py" in c and "--disable-frontend" not in c
               for c in (" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)))

def idle_with_torch():
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.cmdline()[:1] == ["ray::IDLE"] and "libtorch" in open(f"/proc/{p.pid}/maps").read():
                pids.add(p.pid)
        except (psutil.Error, OSError):
            pass
    return pids

assert ensure_ray()
cpus = ray.cluster_resources()["CPU"]
deadline = time.monotonic() + 120
while len(idle_with_torch()) < 2 and time.monotonic() < deadline:
    time.sleep(0.5)
time.sleep(2)  # idle for longer than Ray's idle_worker_killing_time_threshold_ms
ahead = idle_with_torch()
group = RankGroup.create([{"CPU": cpus / 2}] * 2, "cpu")
group.wait_placed(120)
ranks = group.refresh(Deadline(120))
worker = ray.get(ray.remote(num_cpus=0)(imported).remote(), timeout=120)  # after: a worker that ran a task takes no actor
print(json.dumps({"worker": worker, "ranks on workers started ahead": sum(r.pid in ahead for r in ranks),
                  "driver has torch": "torch" in sys.modules, "dashboard": dashboard()}))
group.release()
ray.shutdown()
"""


@pytest.mark.own_processes  # the Ray raylazy starts
@pytest.mark.ray
def test_the_ray_raylazy_starts_has_ranks_on_workers_that_imported_torch_not_the_driver():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "worker": {"torch": True, "raylazy.io.backends": True}, "ranks on workers started ahead": 2,
        "driver has torch": False, "dashboard": False}


@pytest.mark.ray
def test_a_load_says_where_its_time_went(llama_dir, ray_local):
    with raylazy.load(llama_dir, 2, device="cpu", progress=False) as loaded:
        phases = loaded.phases
        assert list(phases) == ["start", "plan", "ready", "read", "copy"]
        assert all(v >= 0 for v in phases.values())
        assert 0.9 * loaded.seconds <= sum(phases.values()) <= loaded.seconds
        assert phases["read"] >= max(s.seconds for s in loaded.stats)
        assert f"read {phases['read']:.2f}" in loaded.summary()
