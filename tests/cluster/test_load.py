"""raylazy.load end to end on Ray: shards bit for bit, code next to the shards, bytes read,
placement across nodes, direct tensor transport, release and errors, progress.

Costs: every Ray start and every actor start (an actor imports torch) takes seconds on a
small machine, so the tests share clusters and loads:

* `TestMultiNode` runs on the session's two-node `ray.cluster_utils.Cluster` (`two_node_cluster`,
  shared with the other multi-node tests, which all run at the end of the session).
* `TestShards` makes one load per (checkpoint, tp, backend), checked by several tests, then
  released, into the same four rank actors of its own (`load(actors=)`), started once.
* The remaining tests use `ray_local` and load what they need (tp 1 or 2).

TestShards' rank actors are of a RankLoader subclass that records the process's `rchar`
(bytes returned by read syscalls, /proc/<pid>/io) around `load()`, so the bytes each rank
read can be compared with the plan.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import time
from collections import Counter

import pytest
import torch

import raylazy
from raylazy.cluster.actor import RankLoader
from raylazy.core.plans import format_bytes
from raylazy.errors import PlacementError, RankFailedError, UnknownArchitectureError
from raylazy.io.stats import proc_io
from tests.support.checkpoints import shard_files
from tests.support.measured import header_bytes
from tests.support.planlib import as_bytes, reference_shard
from tests.support.raytest import (
    actor_ids,
    assert_no_leaks,
    check_ranks,
    digest,
    full_tensors,
    live,
    load_with,
    raylazy_actors,
    raylazy_groups,
    where_am_i,
)

try:  # actor classes and functions defined here travel by value: workers need not import this file
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except Exception:  # noqa: BLE001  (Ray missing: the tests below skip)
    pass

ray = pytest.importorskip("ray")

KINDS = ("llama", "qwen2", "mixtral")
TPS = (1, 2, 4)
#: TestShards' loads: (kind, tp, backend): the default at every tp (ranged alone at tp=1, cooperative on one node
#: above), and the positional reader at tp 2 and 4.
CASES = [(k, tp, "auto") for k in KINDS for tp in TPS] + [(k, tp, "ranged") for k in KINDS for tp in (2, 4)]


# --- helpers --------------------------------------------------------------------------------------


class RcharLoader(RankLoader):
    """A RankLoader that records its process's rchar at the start and end of `load()`."""

    def __init__(self, rank: int, device: str = "auto"):
        super().__init__(rank, device)
        import torch

        import raylazy.io.backends  # noqa: F401  (the readers imported now, so load() reads no .py files)

        # torch's CPU thread pool starts (reading /proc and /sys) on its first parallel copy: now, not in load()
        torch.zeros(1 << 20, dtype=torch.uint8).as_strided((512, 1024), (2048, 1)).clone()

        self._rchar: tuple[int, int] | None = None

    def load(self, plan, options, node_read=None):
        before = proc_io()
        try:
            return super().load(plan, options, node_read)
        finally:
            # the bytes of the first reading itself count between the two readings: leave them out
            self._rchar = (before["rchar"] + before["probe"], proc_io()["rchar"])

    def rchar_window(self) -> tuple[int, int] | None:
        """(rchar when load() started, rchar when it ended)."""
        return self._rchar


def truncating_loader(path: str, size: int) -> type:
    """A RankLoader class whose load() first truncates `path` to `size` bytes (after planning)."""

    class TruncatingLoader(RankLoader):
        def load(self, plan, options, node_read=None):
            os.truncate(path, size)
            return super().load(plan, options, node_read)

    return TruncatingLoader


# --- multi-node placement (the two-node cluster) ----------------------------------------------------


@pytest.mark.ray
@pytest.mark.usefixtures("two_node_cluster")
class TestMultiNode:
    """Two Ray nodes on this machine, each with 2 CPUs and 2 logical GPUs."""

    @staticmethod
    def _load_and_check(llama_dir: str, tp: int, strategy: str) -> list[str]:
        """Load, check the three views of placement agree and the shards are right; returns rank -> node id."""
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        before = live()
        loaded = raylazy.load(llama_dir, tp, use_gpu=True, device="cpu", placement_strategy=strategy,
                              progress=False, placement_timeout_s=120)
        try:
            node_map = loaded.node_map()
            table = ray.util.placement_group_table(loaded.placement_group)
            inside = ray.get(loaded.run(where_am_i), timeout=120)
            assert sorted(node_map) == list(range(tp))
            for r in range(tp):
                node_id, device = node_map[r]
                assert device == "cpu"
                assert node_id in nodes
                assert inside[r]["rank"] == r
                assert inside[r]["node_id"] == node_id == loaded.ranks[r].node_id, f"rank {r}"
                assert table["bundles_to_node_id"][r] == node_id, f"rank {r}: bundle on another node"
                assert len(inside[r]["gpu_ids"]) == 1 and inside[r]["gpu_ids"] == loaded.ranks[r].gpu_ids
            # no two ranks on one node share a GPU
            per_node_gpus = Counter((node_map[r][0], inside[r]["gpu_ids"]) for r in range(tp))
            assert max(per_node_gpus.values()) == 1, per_node_gpus
            check_ranks(loaded.plan, ray.get(loaded.refs()), llama_dir)
            placed = [node_map[r][0] for r in range(tp)]
        finally:
            loaded.release()
        assert_no_leaks(before, f"{strategy} release")
        return placed

    def test_pack_fills_both_nodes(self, llama_dir):
        placed = self._load_and_check(llama_dir, 4, "PACK")
        # 4 ranks of 1 GPU on nodes of 2 GPUs: PACK must fill both nodes, 2 ranks each, and Ray packs
        # bundles in order (a node takes as many as fit before the next is used): ranks 0,1 | 2,3
        assert sorted(Counter(placed).values()) == [2, 2], placed
        assert placed[0] == placed[1] != placed[2] == placed[3], f"PACK should fill one node, then the next: {placed}"

    def test_spread_alternates_nodes(self, llama_dir):
        placed = self._load_and_check(llama_dir, 4, "SPREAD")
        assert sorted(Counter(placed).values()) == [2, 2], placed
        # Ray's SPREAD gives each node one bundle per round, in bundle order for the first round
        # only: ranks 0,1 go to different nodes, 2,3 to the two GPUs left, in either order. Strict
        # alternation (0,2 | 1,3) is common but not promised: [A, B, B, A] happens too.
        assert placed[0] != placed[1] and placed[2] != placed[3], f"SPREAD should alternate nodes: {placed}"

    def test_strict_spread_one_rank_per_node(self, llama_dir):
        placed = self._load_and_check(llama_dir, 2, "STRICT_SPREAD")
        assert len(set(placed)) == 2, placed


# --- one load per (checkpoint, tp), several checks each ----------------------------------------------


@pytest.mark.ray
class TestShards:
    @pytest.fixture(scope="class")
    @classmethod
    def actors(cls, ray_local):
        """Four `RcharLoader` rank actors for every load of the class (an actor start imports torch: seconds)."""
        actors = [ray.remote(num_cpus=1)(RcharLoader).remote(r, "cpu") for r in range(max(TPS))]
        yield actors
        for a in actors:
            ray.kill(a)

    @pytest.fixture(scope="class", params=CASES, ids=lambda p: f"{p[0]}-tp{p[1]}" + ("" if p[2] == "auto" else f"-{p[2]}"))
    @classmethod
    def case(cls, request, actors):
        kind, tp, backend = request.param
        model_dir = request.getfixturevalue(f"{kind}_dir")
        loaded = raylazy.load(model_dir, tp, device="cpu", progress=False, backend=backend, actors=actors[:tp])
        try:
            yield kind, tp, model_dir, loaded
        finally:
            loaded.release()

    def test_refs_equal_reference_shards(self, case):
        kind, tp, model_dir, loaded = case
        assert loaded.tp == tp and len(loaded.ranks) == tp and [i.rank for i in loaded.ranks] == list(range(tp))
        per_rank = ray.get(loaded.refs(), timeout=120)
        check_ranks(loaded.plan, per_rank, model_dir)
        if loaded.options.reader.backend == "ranged":  # asked for: every rank reads its own ranges, no node schedule
            assert {s.backend for s in loaded.stats} == {"ranged"} and loaded.plan.nodes == ()
        # the plan really splits: at tp > 1 some shards are smaller than their tensor
        split = [t for t in loaded.plan.ranks[0].tensors if t.shape != t.full_shape]
        assert bool(split) == (tp > 1)
        # get() is the same as the refs
        assert digest(loaded.get(tp - 1)) == digest(per_rank[tp - 1])

    def test_run_inside_each_actor(self, case):
        kind, tp, model_dir, loaded = case
        inside = ray.get(loaded.run(where_am_i), timeout=120)
        per_rank = ray.get(loaded.refs(), timeout=120)
        pids = [i["pid"] for i in inside]
        assert [i["rank"] for i in inside] == list(range(tp))
        assert pids == [info.pid for info in loaded.ranks]
        assert os.getpid() not in pids and len(set(pids)) == tp
        assert [i["digest"] for i in inside] == [digest(s) for s in per_rank]
        assert all(i["devices"] == ["cpu"] for i in inside)
        # arguments reach fn after (rank, shards)
        sizes = ray.get(loaded.run(lambda rank, shards, scale: scale * sum(t.numel() for t in shards.values()), 2))
        assert sizes == [2 * sum(t.numel() for t in s.values()) for s in per_rank]

    def test_bytes_read_match_plan(self, case):
        """rchar of every rank's process over its load() (measured by the test's rank class, `RcharLoader`) = the
        bytes its reads cover as planned + its header checks (8 + N per file), within 2% and a page, for the
        positional reader (ranged: asked for, or alone at tp=1). Cooperative ranks copy out of mappings of the page
        cache, which rchar does not count: only their header checks are read calls (what a node reads from
        storage is measured in tests/io/test_coop.py). The rank's own measurement, `ReadStats.rchar`, lies between."""
        kind, tp, model_dir, loaded = case
        windows = ray.get([a.rchar_window.remote() for a in loaded.actors], timeout=60)
        for rp, info, (start, end), stats in zip(loaded.plan.ranks, loaded.ranks, windows, loaded.stats):
            assert proc_io(info.pid)["rchar"] >= end  # the driver sees the same process (actors run locally)
            reads = [r for t in rp.tensors for r in t.reads]
            headers = sum(header_bytes(loaded.plan.files[i].uri) for i in {r.file for r in reads})
            data = 0 if stats.backend == "cooperative" else sum(r.span if r.gather else r.count * r.length for r in reads)
            expected, measured = data + headers, end - start
            assert expected <= stats.rchar <= measured, (rp.rank, expected, stats.rchar, measured)
            assert measured <= 1.02 * expected + 4096, (
                f"{kind} tp={tp} rank {rp.rank} ({stats.backend}): read {measured} bytes, the plan says {expected} "
                "(incl. headers)")


@pytest.mark.ray
def test_release_leaves_nothing(llama_dir, ray_local):
    """A load of its own: release() kills its actors and removes its group, twice is harmless, and
    nothing of it stays alive (whatever other tests left running before)."""
    before = live()
    loaded = raylazy.load(llama_dir, 2, device="cpu", progress=False)
    ids, group = actor_ids(loaded), loaded.placement_group.id.hex()
    assert len(ids) == 2 and all(raylazy_actors().get(a) == "ALIVE" for a in ids)
    assert raylazy_groups().get(group) == "CREATED"
    loaded.release()
    loaded.release()  # idempotent
    assert loaded.actors == [] and loaded.placement_group is None
    assert_no_leaks(before, "release()")
    assert all(raylazy_actors().get(a) == "DEAD" for a in ids) and raylazy_groups().get(group) == "REMOVED"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", (2, 4))
def test_naive_reads_tp_times_more_for_split_tensors(request, kind, tp):
    """From the plan: every rank reading whole tensors reads tp x each split tensor; raylazy reads it ~once."""
    model_dir = request.getfixturevalue(f"{kind}_dir")
    plan = raylazy.plan(model_dir, tp)
    full = full_tensors(model_dir)
    split = {t.name for rp in plan.ranks for t in rp.tensors if t.dim is not None}
    assert split
    planned = Counter()
    for rp in plan.ranks:
        for t in rp.tensors:
            if t.name in split:
                planned[t.name] += t.bytes_read
    naive_total, planned_total = 0, 0
    for name in split:
        nbytes = full[name].numel() * full[name].element_size()
        naive = tp * nbytes
        assert nbytes <= planned[name] <= naive, name
        shard_sum = sum(t.nbytes for rp in plan.ranks for t in rp.tensors if t.name == name)
        if shard_sum == nbytes:  # disjoint shards (no replicated kv heads, no padding): exactly tp x
            assert planned[name] == nbytes and naive == tp * planned[name], name
        naive_total += naive
        planned_total += planned[name]
    ratio = naive_total / planned_total
    # kv heads fewer than tp are read by several ranks (GQA), so a little under tp overall
    assert 0.9 * tp <= ratio <= tp, f"{kind} tp={tp}: naive/planned = {ratio:.2f}"
    # and the whole load: raylazy reads less than every rank reading every non-skipped tensor
    whole = sum(full[t.name].numel() * full[t.name].element_size() for t in plan.ranks[0].tensors)
    assert plan.bytes_read < tp * whole


# --- direct transport ------------------------------------------------------------------------------


class Consumer:
    """Receives shard refs; Ray runs an RDT receive on the `_ray_system` concurrency group, which only
    actors created with `enable_tensor_transport=True` have (else the receive queues behind the task
    waiting for it and the transfer times out)."""

    def receive(self, shards: dict) -> dict:
        return {"pid": os.getpid(), "shards": {k: v.clone() for k, v in shards.items()}}


@pytest.mark.ray
def test_gloo_direct_transport_and_context_manager(llama_dir, ray_local):
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    before = live()
    consumer = ray.remote(num_cpus=0, enable_tensor_transport=True)(Consumer).remote()
    try:
        with raylazy.load(llama_dir, 2, device="cpu", progress=False) as loaded:
            ids = actor_ids(loaded)
            group = create_collective_group(loaded.actors + [consumer], backend="torch_gloo")
            try:
                got = ray.get([consumer.receive.remote(ref) for ref in loaded.refs(transport="gloo")], timeout=180)
            finally:
                destroy_collective_group(group)
            check_ranks(loaded.plan, [g["shards"] for g in got], llama_dir)
            assert got[0]["pid"] not in {i.pid for i in loaded.ranks}
    finally:
        ray.kill(consumer)
    # leaving the with block released the load
    assert loaded.actors == [] and loaded.placement_group is None
    assert_no_leaks(before, "with raylazy.load(...)")
    assert all(raylazy_actors().get(a) == "DEAD" for a in ids)


def _received(rank: int, shards: dict, received: dict) -> dict:
    """Run in the rank actor: what the CUDA IPC ref resolved to, next to the actor's own shards."""
    return {name: (t.device.type, as_bytes(t)) for name, t in received.items()} | {
        "__own__": sorted({t.device.type for t in shards.values()})
    }


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tp1_shards_are_cuda_and_travel_by_cuda_ipc(llama_dir, ray_local):
    if ray.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the local Ray sees no GPU")
    with raylazy.load(llama_dir, 1, device="cuda", use_gpu=True, progress=False) as loaded:
        assert loaded.options.transport == "auto"
        assert loaded.ranks[0].device == "cuda:0" and loaded.ranks[0].gpu_ids
        inside = ray.get(loaded.run(where_am_i), timeout=120)[0]
        assert inside["devices"] == ["cuda:0"]
        # refs() of CUDA shards are CUDA IPC objects. CUDA IPC needs a receiver that Ray gave the
        # same GPU: the driver has none and the rank holds the only one, so the rank itself receives
        # its ref (Ray resolves it in-process from its direct-transport store, not the object store).
        ref = loaded.refs()[0]
        got = ray.get(loaded.actors[0].run.remote(_received, ref), timeout=120)
        assert got.pop("__own__") == ["cuda"]
        full = full_tensors(llama_dir)
        rp = loaded.plan.ranks[0]
        assert sorted(got) == sorted(t.name for t in rp.tensors)
        for t in rp.tensors:
            device, data = got[t.name]
            assert device == "cuda", t.name
            assert data == as_bytes(reference_shard(full[t.name], t)), t.name


# --- errors leave nothing behind ------------------------------------------------------------------


@pytest.mark.ray
def test_plan_failure_raises_and_releases(llama_dir, ray_local, tmp_path):
    bad = tmp_path / "nope"
    shutil.copytree(llama_dir, bad)
    cfg = (bad / "config.json").read_text()
    (bad / "config.json").write_text(re.sub(r'"model_type":\s*"[^"]*"', '"model_type": "nope"', cfg))
    before = live()
    with pytest.raises(UnknownArchitectureError, match="nope"):
        raylazy.load(str(bad), 2, device="cpu", progress=False)
    assert_no_leaks(before, "a failed plan")


@pytest.mark.ray
def test_rank_read_failure_names_ranks_and_file(llama_dir, ray_local, tmp_path):
    copy = tmp_path / "llama"
    shutil.copytree(llama_dir, copy)
    victim = str(copy / shard_files(copy)[0])
    plan = raylazy.plan(str(copy), 2)
    index = [os.path.basename(f.uri) for f in plan.files].index(os.path.basename(victim))
    users = {rp.rank for rp in plan.ranks if any(r.file == index for t in rp.tensors for r in t.reads)}
    assert users
    size = os.path.getsize(victim)
    before = live()
    with pytest.raises(RankFailedError) as info:
        load_with(truncating_loader(victim, size - 1), str(copy), 2, device="cpu", progress=False, backend="ranged")
    err = info.value
    assert set(err.failures) == users
    assert f"load failed on {len(users)} rank(s):" in str(err)
    assert victim in str(err)
    assert all(victim in str(e) for e in err.failures.values())
    assert_no_leaks(before, "a failed rank")


@pytest.mark.ray
def test_placement_error_within_timeout(llama_dir, ray_local):
    before = live()
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="could not place 64 rank"):  # autoscale: wait for nodes to join
        raylazy.load(llama_dir, 64, device="cpu", progress=False, placement_timeout_s=3, autoscale=True,
                     rules=[raylazy.Rule("*", raylazy.Replicated())])  # a plan valid at tp=64
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 3 + 30, elapsed
    assert_no_leaks(before, "a placement timeout")


#: A load's timeout, and how long each of two of its steps takes in `SlowStart`: more than the timeout together.
TIMEOUT_S = 15.0
STEP_S = 0.6 * TIMEOUT_S


class SlowStart(RankLoader):
    """A rank that takes STEP_S more to start (a cold worker on a busy node), then reads its plan's local files
    through a storage whose first open waits STEP_S (a slow mount), registered in its process as any storage is."""

    def __init__(self, rank: int, device: str = "auto"):
        from raylazy.storage import LocalStorage, register_storage

        class SlowMount(LocalStorage):
            delay_s = STEP_S

            def open(self, uri):
                time.sleep(self.delay_s)
                self.delay_s = 0
                return super().open(uri)

        super().__init__(rank, device)
        time.sleep(STEP_S)
        register_storage("", SlowMount)


@pytest.mark.ray
def test_timeout_bounds_the_whole_load_after_placement(llama_dir, ray_local):
    """timeout_s is one bound on the load after placement: the ranks' start and their reads, STEP_S (0.6 x
    timeout_s) each, fail the load once, at timeout_s, with one error (each step with a timeout of its own
    would finish it at 1.2 x timeout_s)."""
    before = live()
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        raylazy.load(llama_dir, 1, device="cpu", progress=False, actor_cls=SlowStart, timeout_s=TIMEOUT_S,
                     backend="ranged")
    elapsed = time.monotonic() - t0
    assert TIMEOUT_S <= elapsed <= 1.1 * TIMEOUT_S + 2, elapsed
    assert list(info.value.failures) == [0] and isinstance(info.value.failures[0], TimeoutError)
    assert re.search(f"(start|load) did not finish within {TIMEOUT_S:.0f} s \\(timeout_s\\)", str(info.value))
    assert_no_leaks(before, "a load past its timeout")


# --- progress bar and summary ----------------------------------------------------------------------


class SlowLoader(RankLoader):
    """A RankLoader whose positional reads take 10 ms more each, so that a load lasts seconds."""

    def load(self, plan, options, node_read=None):
        real = os.preadv

        def preadv(*args):
            time.sleep(0.01)
            return real(*args)

        os.preadv = preadv
        try:
            return super().load(plan, options, node_read)
        finally:
            os.preadv = real


@pytest.mark.ray
def test_progress_bar_and_summary(llama_dir, ray_local, capfd, caplog):
    """The bar shows what the ranks report: it moves while they read and is full only when they say so."""
    from tqdm import tqdm

    caplog.set_level(logging.INFO, logger="raylazy")
    with load_with(SlowLoader, llama_dir, 2, device="cpu", progress=True, threads=1, backend="ranged") as loaded:
        total = loaded.plan.bytes_needed
        assert sum(s.bytes_needed for s in loaded.stats) == total <= sum(s.rchar for s in loaded.stats)  # read, measured
        reported = ray.get([a.progress.remote() for a in loaded.actors], timeout=60)
        assert reported == [rp.stats.bytes_needed for rp in loaded.plan.ranks]
    err = capfd.readouterr().err
    bar = [seg for seg in re.split(r"[\r\n]", err) if "raylazy tp=2" in seg]
    assert bar, err
    percents = [int(re.search(r"(\d+)%", seg).group(1)) for seg in bar]
    assert any(0 < p < 100 for p in percents), f"the bar never showed the ranks part-way: {bar}"
    assert percents == sorted(percents), bar
    size = tqdm.format_sizeof(total)
    assert "100%" in bar[-1] and f"{size}/{size}" in bar[-1], bar[-1]
    lines = [r.getMessage() for r in caplog.records if r.name == "raylazy" and "loaded" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    line = lines[0]
    assert os.path.basename(llama_dir) in line and "tp=2" in line and format_bytes(total) in line, line
    assert re.search(r"\d+\.\d+ s\b", line) and re.search(r"\d+\.\d+ GB/s", line), line
    assert "read calls returned" in line and "(rchar)" in line and "returned ?" not in line, line
