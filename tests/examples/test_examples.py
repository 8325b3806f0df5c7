"""The examples run as the docs say (docs/ray.md, docs/planning.md): a Ray job on a local head node, the I/O-plan
notebook, the cluster launcher config, and the autoscaling experiment on Ray's fake multi-node provider.

Clusters started here stay on loopback, use their own --temp-dir (so no other `ray.init()` on this machine
finds them) and free ports, and are torn down by killing exactly the processes they started: never
`ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.integrations.test_vllm import vllm_python  # noqa: F401  (a fixture)
from tests.support import REPO

pytestmark = pytest.mark.own_processes  # a Ray job, the notebook and the fake autoscaler, each on a Ray of its own

REPO = str(REPO)
EXAMPLES = os.path.join(REPO, "examples")


# ---------------------------------------------------------------- local head node (started and killed by us)


def _free_port(preferred: int | None = None) -> int:
    if preferred is not None:
        with socket.socket() as s:
            try:
                s.bind(("", preferred))
                return preferred
            except OSError:
                pass
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ray_cli() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "ray")
    return [exe] if os.path.exists(exe) else [shutil.which("ray") or "ray"]


def kill_cluster(temp_dir: str) -> int:
    """Kill every process of the cluster whose --temp-dir is `temp_dir`, and their descendants.

    The daemons (gcs_server, raylet, dashboard, monitor, log monitor) carry the temp dir on their
    command line; workers, agents, job drivers and fake worker nodes descend from them.
    """
    import psutil

    me = os.getpid()
    roots = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != me and any(temp_dir in a for a in (p.info["cmdline"] or [])):
                roots.append(p)
        except (psutil.Error, TypeError):
            continue
    procs = {}
    for r in roots:
        procs[r.pid] = r
        try:
            procs.update({c.pid: c for c in r.children(recursive=True)})
        except psutil.Error:
            pass
    procs.pop(me, None)
    for p in procs.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(procs.values()), timeout=15)
    return len(procs)


class HeadNode:
    """`ray start --head` on loopback with its own temp dir and ports; `kill()` stops exactly it."""

    def __init__(self, num_cpus: int = 4):
        self.temp_dir = tempfile.mkdtemp(prefix="rlj", dir="/tmp")  # short: socket paths live under it
        self.port = _free_port(6379)
        self.dashboard_port = _free_port(8265)
        self.env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
                    "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{self.dashboard_port}"}
        self.env.pop("RAY_ADDRESS", None)
        # the job's `python` is this interpreter, as in the docs' activated virtualenv (not whatever PATH has)
        self.env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + self.env.get("PATH", "")
        cmd = _ray_cli() + [
            "start", "--head", f"--temp-dir={self.temp_dir}", f"--port={self.port}",
            "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
            f"--num-cpus={num_cpus}", "--object-store-memory=300000000", "--disable-usage-stats",
        ]
        try:
            # as docs/ray.md: a token in ~/.ray/auth_token if there is none, then token auth for every command
            subprocess.run(_ray_cli() + ["get-auth-token", "--generate"], env=self.env, capture_output=True,
                           check=True, timeout=60)
            out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
            assert out.returncode == 0, f"ray start failed:\n{out.stdout}\n{out.stderr}"
            self._wait_dashboard(120)
        except BaseException:
            self.kill()
            raise

    def _wait_dashboard(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.dashboard_port}/api/version", timeout=5):
                    return
            except urllib.error.HTTPError:  # it answers (401 without a token): up
                return
            except Exception:  # noqa: BLE001  (not up yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def kill(self) -> None:
        kill_cluster(self.temp_dir)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit():
    """docs/ray.md's `ray job submit --working-dir . -- python examples/ray_job.py` succeeds on a local head."""
    head = HeadNode()
    try:
        cmd = _ray_cli() + ["job", "submit", "--working-dir", ".", "--", "python", "examples/ray_job.py", "--tp", "2"]
        out = subprocess.run(cmd, cwd=REPO, env=head.env, capture_output=True, text=True, timeout=420)
        text = out.stdout + out.stderr
        match = re.search(r"raysubmit_\w+", text)
        assert match, f"no submission id in:\n{text}"
        job_id = match.group(0)
        status = subprocess.run(_ray_cli() + ["job", "status", job_id], env=head.env, capture_output=True,
                                text=True, timeout=60)
        logs = subprocess.run(_ray_cli() + ["job", "logs", job_id], env=head.env, capture_output=True,
                              text=True, timeout=60).stdout
        # `ray job status` says "Job '<id>' succeeded" exactly when the status is SUCCEEDED
        assert f"Job '{job_id}' succeeded" in status.stdout + status.stderr, \
            f"job {job_id} did not succeed:\n{text}\n{logs}"
        assert out.returncode == 0, text
        assert "raylazy: loaded" in logs and "tp=2" in logs, logs           # the summary
        assert re.search(r"o_proj: .*max abs error \S+ .* OK", logs), logs  # the error checks
        assert re.search(r"mlp: .*max abs error \S+ .* OK", logs), logs
        assert "check passed" in logs, logs
        # the job imports raylazy from the uploaded working directory, not from this checkout
        imported = re.search(r"imported from (\S+)", logs).group(1)
        assert not imported.startswith(REPO + os.sep), imported
    finally:
        head.kill()


# ---------------------------------------------------------------- the I/O-plan notebook


def _tiny_llama(directory) -> str:
    from raylazy.synthetic import LlamaShape, write_llama_checkpoint

    shape = LlamaShape(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                       num_hidden_layers=2, vocab_size=256)
    return write_llama_checkpoint(str(directory), shape, num_files=2)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_notebook_runs(tmp_path, monkeypatch):
    """examples/io_plan.ipynb runs top to bottom (parameters from the environment) and shows what it promises."""
    import nbformat
    from nbclient import NotebookClient

    model_dir = _tiny_llama(tmp_path / "model")
    monkeypatch.setenv("RAYLAZY_NB_MODEL_DIR", model_dir)
    monkeypatch.setenv("RAYLAZY_NB_TP", "2")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    nb = nbformat.read(os.path.join(EXAMPLES, "io_plan.ipynb"), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}).execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    html = "\n".join(o.get("data", {}).get("text/html", "") for o in outputs)
    assert model_dir in text                                          # the parameter was used
    assert f"plan: {model_dir} (llama), tp=2" in text                 # plan.summary()
    for column in ("bytes_needed", "bytes_read", "requests", "files", "amplification", "planned_bytes_read"):
        assert column in html, column                                 # per-rank, amplification, measured tables
    assert re.search(r"amplification \d+\.\d+x", text), text
    assert "raylazy: loaded" in text and "measured bytes read match the plan: True" in text, text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5              # by-file bars, byte ranges, naive vs raylazy, stripes, predicted timeline
    assert "estimate (raylazy on this machine (local); model output)" in text and "total: predicted" in text
    assert "node node: ranks 0,1 read" in text                        # the node schedule's summary line


# ---------------------------------------------------------------- the cluster launcher config


def test_cluster_yaml_valid():
    """cluster.yaml passes the validation `ray up` applies (defaults filled in, then Ray's JSON schema)."""
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    with open(os.path.join(REPO, "cluster.yaml")) as fh:
        raw = yaml.safe_load(fh)
    config = prepare_config(raw)  # what `ray up` does first: merge the provider's defaults
    validate_config(config)       # raises jsonschema.ValidationError on an unknown or mistyped field

    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    gpu = [t for name, t in types.items() if name != config["head_node_type"]]
    assert "GPU" not in head["resources"]
    assert len(gpu) == 1 and gpu[0]["resources"]["GPU"] == 8
    assert 0 <= gpu[0]["min_workers"] <= gpu[0]["max_workers"] <= config["max_workers"]
    assert any("raylazy" in c for c in config["setup_commands"])

    # the validation is not vacuous: a misspelt field fails it
    import jsonschema

    with open(os.path.join(REPO, "cluster.yaml")) as fh:
        broken = yaml.safe_load(fh)
    broken["available_node_types"]["gpu_worker"]["resourcez"] = {"GPU": 8}
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


# ---------------------------------------------------------------- the autoscaling experiment


class _Experiment:
    """examples/autoscaling_experiment.py running in a child process, its output in files beside its `--out`."""

    def __init__(self, out_dir, *args: str):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.out_dir = str(out_dir)
        self.start = time.monotonic()
        self.stdout, self.stderr = self.out_dir + ".stdout", self.out_dir + ".stderr"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([sys.executable, os.path.join(EXAMPLES, "autoscaling_experiment.py"), *args,
                                          "--out", self.out_dir], cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        self.ended: float | None = None  # when it exited, seen by a thread: the test may look later
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def output(self) -> tuple[str, str]:
        with open(self.stdout) as out, open(self.stderr) as err:
            return out.read(), err.read()

    def wait_head_up(self, timeout: float) -> None:
        """Until its head is up (and so holds its ports: another fake cluster started now picks others)."""
        deadline = time.monotonic() + timeout
        while "head up in" not in self.output()[0]:
            assert self.proc.poll() is None and time.monotonic() < deadline, "\n".join(self.output())
            time.sleep(0.2)

    def finish(self, timeout: float = 420) -> tuple[int, str, str, dict, float]:
        """(exit status, stdout, stderr, timeline.json, seconds from its start to its exit), once it has exited
        (by `timeout` seconds from its start, else it is stopped) and its fake cluster is gone."""
        self._waiter.join(max(1.0, self.start + timeout - time.monotonic()))
        if self.ended is None:
            self.proc.terminate()  # SIGTERM: the script still tears its cluster down
            self._waiter.join(60)
        assert self.ended is not None, f"the experiment did not finish within {timeout:.0f} s"
        rc, elapsed = self.proc.returncode, self.ended - self.start
        stdout, stderr = self.output()
        text = stdout + stderr
        temp_dir = re.search(r"temp dir (\S+)\)", text)
        assert temp_dir, text
        assert not _processes_naming(temp_dir.group(1)), f"the fake cluster was not torn down:\n{text}"
        with open(os.path.join(self.out_dir, "timeline.json")) as fh:
            return rc, stdout, stderr, json.load(fh), elapsed


def _processes_naming(tag: str) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.pid != os.getpid() and any(tag in a for a in (p.info["cmdline"] or [])):
                found.append(p.pid)
        except (psutil.Error, TypeError):
            continue
    return found


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_autoscaling_reduced(tmp_path):
    """On the fake autoscaler, tp=2 at 1 GPU per node: two nodes are added, then the ranks are placed on them
    and load; then a second replica gets two more nodes and copies its shards from the first, reading nothing
    from storage; a request the cluster can never hold (tp=2, one 1-GPU node at most) fails with raylazy's
    PlacementError once the timeout has passed, not a hang."""
    model_dir = _tiny_llama(tmp_path / "model")
    # The two runs are side by side, each on a fake cluster of its own: the one that cannot be placed mostly
    # waits out its timeout. It starts first, and the other once its head holds its ports.
    timeout_s = 15
    never = _Experiment(tmp_path / "never", model_dir, "--tp", "2", "--gpus-per-node", "1", "--max-workers", "1",
                        "--timeout", str(timeout_s))
    try:
        never.wait_head_up(180)
        rc, stdout, stderr, tl, _ = _Experiment(tmp_path / "ok", model_dir, "--tp", "2", "--gpus-per-node", "1",
                                                "--max-workers", "4", "--timeout", "180").finish()
    finally:
        never_rc, never_stdout, never_stderr, never_tl, never_elapsed = never.finish()
    text = stdout + stderr
    assert rc == 0, text
    assert "raylazy: loaded" in stdout and "total load time" in stdout, text
    assert os.path.getsize(tmp_path / "ok" / "timeline.png") > 1000
    workers = {n["node_id"]: n for n in tl["nodes"] if not n["head"]}
    assert len(workers) == 4 and all(n["gpus"] == 1 for n in workers.values()), tl
    assert all(n["seen_at"] > 0 for n in workers.values()), tl            # none before the load asked for GPUs
    assert len(tl["ranks"]) == 2 and len({r["node_id"] for r in tl["ranks"]}) == 2, tl
    assert tl["pg_placed"] is not None
    for r in tl["ranks"]:
        assert r["node_id"] in workers, r                                 # ranks on the added GPU nodes
        assert r["node_added"] < r["started"], tl                         # its node was added before it was placed
        assert r["node_added"] <= tl["pg_placed"], tl                     # (and before the group was)
        assert r["started"] <= r["ready"] <= r["read_start"] <= r["read_end"] <= tl["load_seconds"], r
    # the second replica: on two nodes added for it, its shards copied from the first, nothing from storage
    second = tl["replica"]
    assert "second replica, from the live one" in stdout and "copied from live replicas" in stdout, text
    assert len(second["ranks"]) == 2 and second["start"] >= tl["load_seconds"], second
    first_nodes = {r["node_id"] for r in tl["ranks"]}
    for r in second["ranks"]:
        assert r["node_id"] in workers and r["node_id"] not in first_nodes, r
        # its node was added for it, or earlier when the autoscaler launched ahead of demand (seen on a loaded
        # machine): either way before the rank started there
        assert r["node_added"] < r["started"] <= r["ready"] <= r["read_start"] <= r["read_end"], r
        assert r["bytes_read"] == 0 and r["bytes_from_replica"] > 0, r
    assert sum(r["bytes_from_replica"] for r in second["ranks"]) == sum(r["bytes_read"] for r in tl["ranks"]), tl

    text = never_stdout + never_stderr
    assert never_rc == 2, text
    assert "can never have more than 1" in never_stdout, text             # said up front
    assert "PlacementError: could not place 2 rank(s)" in never_stderr, text
    assert never_tl["error"].startswith("PlacementError") and not never_tl["ranks"], never_tl
    assert timeout_s <= never_tl["load_seconds"] < timeout_s + 15, never_tl  # gave up at the timeout
    assert never_elapsed < timeout_s + 150, never_elapsed                  # cluster start + timeout + teardown


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_autoscaling_vllm_phase_takes_the_checkpoint_from_its_holder(tmp_path, vllm_python):  # noqa: F811
    """With --vllm-python: after the load, the checkpoint is held on every node (read from storage once, its files'
    bytes), then two vLLM engines start one after the other and each takes it from the holder: no tensor byte
    planned from storage, the line of every worker saying `storage=holder`."""
    from raylazy.synthetic import LlamaShape, write_llama_checkpoint

    # head_dim 64: vLLM's CPU attention has no kernel for the tiny Llama's 16
    model_dir = write_llama_checkpoint(str(tmp_path / "model"), LlamaShape(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384, num_hidden_layers=2,
        vocab_size=256), num_files=2)
    rc, stdout, stderr, tl, _ = _Experiment(tmp_path / "vllm", model_dir, "--tp", "1", "--gpus-per-node", "1",
                                            "--max-workers", "1", "--timeout", "180", "--vllm-python", vllm_python,
                                            "--engines", "2").finish(800)
    assert rc == 0, stdout + stderr
    hold, engines = tl["vllm"]["hold"], tl["vllm"]["engines"]
    assert hold["bytes"] == sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir)
                                if n.endswith(".safetensors"))
    assert [(e["storage"], e["planned"]) for e in engines] == [("holder", 0)] * 2, engines
    assert hold["end"] <= engines[0]["start"] < engines[0]["ready"] <= engines[1]["start"] < engines[1]["ready"]
    assert "vLLM engines: the checkpoint held on" in stdout and os.path.getsize(tmp_path / "vllm" / "timeline.png") > 1000
