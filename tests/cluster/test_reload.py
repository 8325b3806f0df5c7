"""Long-lived ranks: `LoadedModel.reload` into the same shard tensors, the caller's own actors as ranks
(`load(actors=)`, `raylazy.RankMixin`), a rank Ray restarts reading its plan again, `raylazy.read_rank`
in any process, and a second Ctrl-C during cleanup.

Every shard is checked bit for bit against the slice of safetensors' get_tensor of the checkpoint it should
hold that its rank's place gives it (`raytest.check_loaded`); `data_ptr`s are compared while a holder keeps the
old tensors alive (`raytest.Holder`), so freed addresses cannot be handed out again. The checkpoints are the session's llama and copies of it written with
other seeds (other values, the same layout) and another shard size (other files, the same rank layout).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import raylazy
from raylazy.core.options import ReaderOptions
from raylazy.core.plans import check_same_layout
from raylazy.errors import ConfigurationError, LayoutMismatchError, NoShardsError, RankFailedError, ReadError
from tests.support import REPO
from tests.support.checkpoints import build_checkpoint
from tests.support.raytest import (
    Holder,
    assert_no_leaks,
    check_loaded,
    check_rank,
    digest,
    live,
    load_with,
    pointers,
    raylazy_groups,
    wait_for,
    where_am_i,
)

try:  # classes and functions defined here travel to the actors by value
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except Exception:  # noqa: BLE001  (Ray missing: the Ray tests skip)
    pass

ROOT = str(REPO)


@pytest.fixture(scope="module")
def llama_b(tmp_path_factory) -> str:
    """The llama of `llama_dir` with other values (seed 7) and other files (a larger shard size)."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama_b"), seed=7, max_shard_size="200KB")


@pytest.fixture(scope="module")
def llama_c(tmp_path_factory) -> str:
    """The same layout again, seed 8."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama_c"), seed=8)


@pytest.fixture(scope="module")
def llama_f16(tmp_path_factory) -> str:
    """The llama in float16: the same names and shapes, another dtype."""
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama_f16"), dtype=torch.float16)


def restarted(loaded, rank: int, old_pid: int) -> None:
    """Wait until `loaded.ranks` shows rank `rank` in a process other than `old_pid` (a call that reaches the
    process while it dies may fail: asked again)."""

    def new_pid() -> bool:
        try:
            return loaded.ranks[rank].pid != old_pid
        except RankFailedError:
            return False

    wait_for(new_pid, 60, f"rank {rank} to restart")


# --- without Ray ---------------------------------------------------------------------------------------


def test_read_rank_runs_a_rank_plan_alone_in_this_process(llama_dir):
    """raylazy.read_rank: a node backend without its NodeRead reads ranged; out= is filled in place."""
    plan = raylazy.plan(llama_dir, 2)
    for rp in plan.ranks:
        shards, stats = raylazy.read_rank(rp, "cpu", options=ReaderOptions(backend="cooperative"))
        assert stats.backend == "ranged" and stats.bytes_needed == rp.stats.bytes_needed
        check_rank(rp, shards, llama_dir)
        before = {n: t.data_ptr() for n, t in shards.items()}  # `shards` holds the tensors meanwhile
        for t in shards.values():
            t.view(-1).view(torch.uint8).fill_(0x5A)
        again, _ = raylazy.read_rank(rp, "cpu", out=shards)
        assert {n: t.data_ptr() for n, t in again.items()} == before
        assert all(again[t.name] is shards[t.name] for t in rp.tensors)
        check_rank(rp, again, llama_dir)


def test_layout_check_names_the_first_difference(llama_dir, llama_b, llama_f16, qwen2_dir):
    a = raylazy.plan(llama_dir, 2)
    check_same_layout(a, raylazy.plan(llama_b, 2))  # other values and files, the same rank layout
    with pytest.raises(LayoutMismatchError) as info:
        check_same_layout(a, raylazy.plan(llama_f16, 2))
    first = sorted(t.name for t in a.ranks[0].tensors)[0]
    shape = list(next(t.shape for t in a.ranks[0].tensors if t.name == first))
    msg = str(info.value)
    assert llama_f16 in msg and f"rank 0's tensor {first!r} is F16 {shape}" in msg and f"BF16 {shape}" in msg, msg
    with pytest.raises(LayoutMismatchError, match=r"'lm_head.weight' is absent in the new checkpoint but BF16"):
        check_same_layout(a, raylazy.plan(llama_b, 2, rules=[("lm_head.weight", raylazy.Skip())]))
    with pytest.raises(LayoutMismatchError, match=r"is BF16 \[64, 48\] in the new checkpoint but BF16 \[64, 64\]"):
        check_same_layout(a, raylazy.plan(qwen2_dir, 2))  # another model: other shapes
    with pytest.raises(LayoutMismatchError, match="planned for 4 ranks, the loaded model has 2"):
        check_same_layout(a, raylazy.plan(llama_dir, 4))


# --- reload --------------------------------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.parametrize("backend,used", [("auto", "cooperative"), ("exchange", "exchange")])
def test_reload_fills_the_same_tensors_of_the_same_actors(llama_dir, llama_b, llama_c, llama_f16, ray_local, backend,
                                                          used):
    import ray

    with load_with(Holder, llama_dir, 2, device="cpu", progress=False, backend=backend) as loaded:
        check_loaded(loaded, llama_dir)
        ptrs = ray.get(loaded.run(pointers), timeout=60)
        pids = [i.pid for i in loaded.ranks]
        ray.get([a.hold.remote() for a in loaded.actors], timeout=60)
        for model_dir in (llama_b, llama_c, llama_dir):
            assert loaded.reload(model_dir) is loaded
            assert loaded.plan.root == model_dir and {s.backend for s in loaded.stats} == {used}
            check_loaded(loaded, model_dir)  # refs() and get() give the new weights, not the old copies
            assert ray.get(loaded.run(pointers), timeout=60) == ptrs, "a reload must not allocate"
            assert [i.pid for i in loaded.ranks] == pids
            inside = ray.get(loaded.run(where_am_i), timeout=60)
            held = ray.get([a.held_digest.remote() for a in loaded.actors], timeout=60)
            assert held == [r["digest"] for r in inside], "a consumer holding the tensors sees the new weights"
        # another layout: refused on the driver before any byte is written; the shards stay as they were
        with pytest.raises(LayoutMismatchError, match="F16"):
            loaded.reload(llama_f16)
        assert ray.get(loaded.run(where_am_i), timeout=60) == inside
        check_loaded(loaded, llama_dir)
    with pytest.raises(NoShardsError, match="released"):
        loaded.reload(llama_b)


def faulty_holder(fault: dict) -> type:
    """A rank whose `fault["rank"]` meets `fault["kind"]` at its `fault["after"]`-th positional read of a reload:
    "eio" raises an I/O error, "die" ends the process (first attempt only: `fault["marker"]` is then written)."""

    class FaultyHolder(Holder):
        def reload(self, plan, options, node_read=None):
            if self.info().rank != fault["rank"] or os.path.exists(fault["marker"]):
                return super().reload(plan, options, node_read)
            real, calls = os.preadv, []

            def preadv(fd, buffers, offset, *args):
                calls.append(1)
                if len(calls) == fault["after"]:
                    open(fault["marker"], "w").close()
                    if fault["kind"] == "die":
                        os._exit(1)
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                return real(fd, buffers, offset, *args)

            os.preadv = preadv
            try:
                return super().reload(plan, options, node_read)
            finally:
                os.preadv = real

    return FaultyHolder


@pytest.mark.ray
def test_a_reload_failing_part_way_leaves_the_rank_without_shards_until_it_succeeds(llama_dir, llama_b, ray_local,
                                                                                     tmp_path):
    import ray

    fault = {"rank": 1, "kind": "eio", "after": 3, "marker": str(tmp_path / "failed")}
    with load_with(faulty_holder(fault), llama_dir, 2, device="cpu", progress=False, backend="ranged") as loaded:
        ptrs = ray.get(loaded.run(pointers), timeout=60)
        ray.get([a.hold.remote() for a in loaded.actors], timeout=60)  # the old tensors stay: their addresses too
        with pytest.raises(RankFailedError) as info:
            loaded.reload(llama_b)
        assert list(info.value.failures) == [1] and isinstance(info.value.failures[1], ReadError)
        assert str(info.value).startswith("reload failed on 1 rank(s):"), str(info.value)
        assert "Input/output error" in str(info.value.failures[1])
        with pytest.raises(NoShardsError, match="holds no shards"):  # partly overwritten: never served
            ray.get(loaded.actors[1].shards.remote(), timeout=60)
        with pytest.raises(NoShardsError):
            ray.get(loaded.actors[1].run.remote(where_am_i), timeout=60)
        assert loaded.plan.root == llama_dir  # the plan of the last successful read
        check_rank(raylazy.plan(llama_b, 2).ranks[0], ray.get(loaded.actors[0].shards.remote(), timeout=60), llama_b)
        loaded.reload(llama_b)  # the marker exists: no fault this time
        check_loaded(loaded, llama_b)
        assert ray.get(loaded.run(pointers), timeout=60) == ptrs


@pytest.mark.ray
@pytest.mark.parametrize("retries", (0, 2))
def test_a_rank_dying_mid_reload_fails_once_or_is_restarted(llama_dir, llama_b, ray_local, tmp_path, retries):
    import ray

    fault = {"rank": 0, "kind": "die", "after": 3, "marker": str(tmp_path / "died")}
    before = live()
    loaded = load_with(faulty_holder(fault), llama_dir, 2, device="cpu", progress=False, backend="ranged",
                       max_retries=retries, timeout_s=120)
    try:
        pids = [i.pid for i in loaded.ranks]
        if retries:  # restarted, the retried reload reads into new tensors in the new process
            loaded.reload(llama_b)
            check_loaded(loaded, llama_b)
            assert loaded.ranks[0].pid != pids[0] and loaded.ranks[1].pid == pids[1]
        else:
            t0 = time.monotonic()
            with pytest.raises(RankFailedError) as info:
                loaded.reload(llama_b)
            assert list(info.value.failures) == [0] and time.monotonic() - t0 < 60
            assert "ActorDied" in type(info.value.failures[0]).__name__, repr(info.value.failures[0])
            check_rank(raylazy.plan(llama_b, 2).ranks[1], ray.get(loaded.actors[1].shards.remote(), timeout=60), llama_b)
        assert os.path.exists(fault["marker"])
    finally:
        loaded.release()
    assert_no_leaks(before, "release after a rank died mid-reload")


# --- restart after a completed read --------------------------------------------------------------------


@pytest.mark.ray
def test_a_rank_restarted_after_a_reload_reads_the_reloaded_plan_again(llama_dir, llama_b, ray_local):
    import ray

    with raylazy.load(llama_dir, 2, device="cpu", progress=False) as loaded:  # cooperative
        loaded.reload(llama_b)
        first = ray.get(loaded.run(where_am_i), timeout=60)
        os.kill(first[1]["pid"], signal.SIGKILL)
        restarted(loaded, 1, first[1]["pid"])
        again = ray.get(loaded.run(where_am_i), timeout=60)
        assert again[1]["pid"] == loaded.ranks[1].pid and again[0]["pid"] == first[0]["pid"]
        assert [r["digest"] for r in again] == [r["digest"] for r in first]
        check_loaded(loaded, llama_b)  # read alone (ranged): a cooperative NodeRead is not replayed
        loaded.reload(llama_dir)  # the restarted rank reloads in place with its node's peer again
        check_loaded(loaded, llama_dir)


# --- the caller's own actors ---------------------------------------------------------------------------


class Engine(raylazy.RankMixin):
    """An inference worker of the caller's, with its own constructor and methods, made a rank by the mixin."""

    def __init__(self, name: str):
        self.name = name
        self.model = None

    def build(self) -> None:
        self.model = dict(self.shards())  # the engine's "model" holds the shard tensors

    def model_digest(self) -> str:
        return digest(self.model)

    def hello(self) -> str:
        return self.name


@pytest.mark.ray
def test_load_into_the_callers_actors_and_reload_them(llama_dir, llama_b, ray_local):
    import ray

    engine = ray.remote(num_cpus=0.5, max_concurrency=4, max_restarts=1, max_task_retries=1)(Engine)
    engines = [engine.remote(f"engine{r}") for r in range(2)]
    groups = set(raylazy_groups())
    try:
        with pytest.raises(ConfigurationError, match="2 actor"):
            raylazy.load(llama_dir, 4, device="cpu", actors=engines)
        plain = ray.remote(num_cpus=0)(type("Plain", (), {"ping": lambda self: 1})).remote()
        with pytest.raises(ConfigurationError, match="RankMixin"):
            raylazy.load(llama_dir, 2, device="cpu", actors=[engines[0], plain])
        ray.kill(plain)
        loaded = raylazy.load(llama_dir, 2, device="cpu", progress=False, actors=engines)
        assert set(raylazy_groups()) == groups, "no placement group of raylazy's own"
        assert loaded.placement_group is None and loaded.actors == engines
        check_loaded(loaded, llama_dir)
        ray.get([e.build.remote() for e in engines], timeout=60)
        ptrs = ray.get(loaded.run(pointers), timeout=60)
        loaded.reload(llama_b)
        check_loaded(loaded, llama_b)
        assert ray.get(loaded.run(pointers), timeout=60) == ptrs
        inside = ray.get(loaded.run(where_am_i), timeout=60)
        assert ray.get([e.model_digest.remote() for e in engines]) == [r["digest"] for r in inside]
        # restarted by Ray (the caller's max_restarts), an engine reads its last plan at its first raylazy call
        os.kill(inside[0]["pid"], signal.SIGKILL)
        restarted(loaded, 0, inside[0]["pid"])
        check_loaded(loaded, llama_b)
        loaded.release()  # the engines live on, without shards
        assert ray.get([e.hello.remote() for e in engines], timeout=60) == ["engine0", "engine1"]
        with pytest.raises(NoShardsError, match="holds no shards"):
            ray.get(engines[0].shards.remote(), timeout=60)
        with raylazy.load(llama_b, 2, device="cpu", progress=False, actors=engines[::-1]) as again:
            assert [i.rank for i in again.ranks] == [0, 1] and again.actors[0] is engines[1]
            check_loaded(again, llama_b)
    finally:
        for e in engines:
            ray.kill(e)


# --- a second Ctrl-C during cleanup ---------------------------------------------------------------------

CHILD = r"""
import json, os, signal, sys, threading, time
import ray, raylazy
from raylazy.cluster.actor import RankLoader

signal.signal(signal.SIGINT, signal.default_int_handler)  # as interactive: a test run in the background ignores it

address, model_dir, marker = sys.argv[1:4]
ray.init(address=address, logging_level="WARNING")


class Blocked(RankLoader):  # every rank blocks in its load: the driver waits until interrupted
    def load(self, plan, options, node_read=None):
        open(marker + str(plan.rank), "w").close()
        time.sleep(600)


real_kill = ray.kill


def slow_kill(actor, **kw):  # a slow cleanup: the second Ctrl-C lands in the middle of it
    open(marker + "cleanup", "w").close()
    time.sleep(1.0)
    return real_kill(actor, **kw)


ray.kill = slow_kill
try:
    raylazy.load(model_dir, 2, device="cpu", progress=False, actor_cls=Blocked)
except KeyboardInterrupt:
    print("interrupted", flush=True)
time.sleep(600)  # alive: Ray would clean up after a driver that exits, hiding a leak
"""


@pytest.mark.ray
def test_a_second_ctrl_c_during_cleanup_leaks_nothing(llama_dir, ray_local, tmp_path):
    import ray

    script, marker = tmp_path / "child.py", str(tmp_path / "m")
    script.write_text(CHILD)
    before = live()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, str(script), ray.get_runtime_context().gcs_address, llama_dir, marker],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(lambda: os.path.exists(marker + "0") and os.path.exists(marker + "1"), 120, "the ranks to block")
        child.send_signal(signal.SIGINT)
        wait_for(lambda: os.path.exists(marker + "cleanup") or child.poll() is not None, 60, "the cleanup")
        child.send_signal(signal.SIGINT)
        out = []
        wait_for(lambda: out.append(child.stdout.readline()) or "interrupted" in out[-1] or child.poll() is not None,
                 60, "the child to catch the interrupt")
        assert child.poll() is None, child.stderr.read()
        assert_no_leaks(before, "two Ctrl-C in a row")
    finally:
        child.kill()
        child.communicate()


# --- the example -------------------------------------------------------------------------------------


@pytest.mark.own_processes  # the example starts a Ray of its own
@pytest.mark.ray
def test_rl_reload_loop_example_runs_small(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rl_reload_loop.py"), "--tp", "2",
                           "--steps", "3", "--work", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    assert [l["step"] for l in lines] == [0, 1, 2] and all(l["match"] for l in lines), proc.stdout
    assert all(l["same_tensors"] and l["pids"] == lines[0]["pids"] for l in lines), proc.stdout
