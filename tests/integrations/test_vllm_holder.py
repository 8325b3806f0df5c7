"""vLLM engines (CPU build) taking their checkpoint from a holder in Ray (`raylazy.hold`) instead of storage: two
checkpoints on the emulated network mount in its `direct` mode (every read a request the mount counts), each held;
engines at tp=1 and tp=2 started one after the other load the first and reload in place to the second
(`reload_weights`). The oracles: engines on vLLM's default loader started fresh on each checkpoint's own files (prompt
logprobs, bit for bit), and what the mount served (each checkpoint's bytes once, for the holder; each engine's
workers read headers only). Then, in a second process: an engine whose holder was released and one whose checkpoint
changed since it was held read storage, each saying why in its log, and load the checkpoint as it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from tests.integrations.test_vllm import vllm_python  # noqa: F401  (a fixture)
from tests.integrations.test_vllm_reload import PROMPTS
from tests.support import REPO
from tests.support.checkpoints import build_checkpoint, file_bytes, header_bytes, probe_bytes

pytestmark = [pytest.mark.own_processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Ray of the test's own, and two Llama checkpoints (the second a later training step) on emulated mounts in
    their `direct` mode, each held: ({"mounts": [...], "dirs": [...], "env": the engines' environment})."""
    import logging

    import ray

    import raylazy
    from benchmarks.netfs import NetFS, fuse_problem

    if (why := fuse_problem()) is not None:
        if os.environ.get("RAYLAZY_REQUIRE_FUSE") == "1":
            pytest.fail(f"RAYLAZY_REQUIRE_FUSE=1 but FUSE cannot mount here: {why}")
        pytest.skip(f"no FUSE mount on this machine: {why}")
    root = tmp_path_factory.mktemp("held")
    dirs = [build_checkpoint("vllm-llama", root / f"step{s}", dtype=torch.bfloat16, max_shard_size="200KB", seed=s)
            for s in range(2)]
    mounts = [NetFS(d, mode="direct", attr_timeout_s=0.0) for d in dirs]
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    try:
        for fs in mounts:
            raylazy.hold(fs.mountpoint)
        env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1",
                   VLLM_WORKER_MULTIPROC_METHOD="spawn", RAY_ADDRESS=ray.get_runtime_context().gcs_address)
        yield {"mounts": mounts, "dirs": dirs, "env": env, "filled": [fs.served() for fs in mounts]}
    finally:
        ray.shutdown()
        for fs in mounts:
            fs.close()


def _start(python: str, runs: list[dict], env: dict) -> list[dict]:
    """Each run's result (tests/support/vllm/reloads.py), with `log`: the raylazy lines its engine printed."""
    out = subprocess.run([python, str(REPO / "tests" / "support" / "vllm" / "reloads.py"), "--runs", json.dumps(runs),
                          "--prompts", json.dumps(PROMPTS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, timeout=1100).stdout
    results, log = [], []
    for line in out.splitlines():
        if line.startswith("RESULT "):
            results.append(json.loads(line[len("RESULT "):]) | {"log": log})
            log = []
        elif "raylazy: " in line:
            log.append(line)
    assert len(results) == len(runs), out[-5000:]
    return results


@pytest.fixture(scope="module")
def held_runs(vllm_python, cluster) -> list[dict]:  # noqa: F811  (the fixture imported above)
    (m0, m1), (d0, d1) = [fs.mountpoint for fs in cluster["mounts"]], cluster["dirs"]
    return _start(vllm_python, [{"model": m0, "format": "raylazy", "tp": 1},
                                {"model": m0, "format": "raylazy", "tp": 2, "bind": "0|1", "steps": [{"path": m1}]},
                                {"model": d0, "format": "auto", "tp": 1},
                                {"model": d0, "format": "auto", "tp": 2, "bind": "0|1"},
                                {"model": d1, "format": "auto", "tp": 2, "bind": "0|1"}], cluster["env"])


def test_engines_take_the_checkpoint_from_its_holder_and_the_mount_serves_it_once(held_runs, cluster):
    tp1, tp2, fresh_tp1, fresh_tp2, fresh_step1 = held_runs
    assert tp1["logprobs"] == fresh_tp1["logprobs"] and tp2["logprobs"] == fresh_tp2["logprobs"]
    [step] = tp2["steps"]  # the reload, to the second checkpoint: a fresh engine's on it
    assert step["error"] is None and step["logprobs"] == fresh_step1["logprobs"] != tp2["logprobs"]
    assert [line["storage"] for line in step["lines"]] == ["holder"] * 2
    for run, loads in ((tp1, 1), (tp2, 4)):  # every worker's load (and reload) log line
        lines = [line for line in run["log"] if "raylazy: rank" in line]
        assert len(lines) == loads and all("storage=holder" in line for line in lines), run["log"]
    # each mount: the holder's read (and its probe of the mount: `raylazy.storage.probe`), then the engines'
    # workers' headers (the first: 3 workers; the second: 2); a worker the holder serves probes nothing
    for fs, filled, d, workers in zip(cluster["mounts"], cluster["filled"], cluster["dirs"], (3, 2)):
        assert filled <= file_bytes(d) + 3 * header_bytes(d) + probe_bytes(d)
        assert fs.served() - filled <= workers * header_bytes(d), (fs.served() - filled, header_bytes(d))


def test_an_engine_reads_storage_when_its_holder_is_gone_or_stale_and_says_why(held_runs, vllm_python, cluster):  # noqa: F811
    import raylazy
    from raylazy.cluster.holder import find

    (m0, m1), (d0, d1) = [fs.mountpoint for fs in cluster["mounts"]], cluster["dirs"]
    find(m0).release()
    for name in os.listdir(d1):  # the second checkpoint rewritten under its mount: the first's weights, one layout
        if name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(d0, name), os.path.join(d1, name))
    assert raylazy.holders() and all(i.root == m1 for i in raylazy.holders())
    gone, stale = _start(vllm_python, [{"model": m0, "format": "raylazy", "tp": 1},
                                       {"model": m1, "format": "raylazy", "tp": 1}], cluster["env"])
    # both read the checkpoint as it is now: the first's weights (a fresh engine's on it)
    assert gone["logprobs"] == stale["logprobs"] == held_runs[2]["logprobs"]
    assert any("no holder served it (HolderGoneError" in line for line in gone["log"]), gone["log"]
    assert any("no holder served it (StaleHolderError" in line for line in stale["log"]), stale["log"]
    for run in (gone, stale):
        assert [line for line in run["log"] if "raylazy: rank" in line and "storage=fuse" in line], run["log"]
