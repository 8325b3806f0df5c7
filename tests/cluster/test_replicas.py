"""Replicas and loads from a live model: replica 0 reads storage once, the others copy its shards;
a new model copies from a live one with no storage access; a source that dies mid-copy falls back to storage,
or fails with one PeerFailedError when the checkpoint is gone.

The Ray tests share one two-node cluster (`two_node_cluster`: 2 nodes x 2 CPUs, 2 logical GPUs each); shards
are checked bit for bit against the slice of safetensors' tensors each rank's place gives it (`raytest.check_rank`).
Who read storage is what the ranks' processes measured (`ReadStats.rchar`: their read calls) and what the test's
rank class counted (its `load` and `peer_shards` calls), not the plan's figures.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

import pytest

import raylazy
from raylazy.core.mesh import Coord, Mesh
from raylazy.errors import ConfigurationError, PeerFailedError
from raylazy.planning import make_plan
from tests.support.checkpoints import build_checkpoint
from tests.support.measured import SyscallLog
from tests.support.raytest import Holder, assert_no_leaks, check_rank, digest, live, pointers

try:  # actor classes defined here travel by value: workers need not import this file
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except Exception:  # noqa: BLE001  (Ray missing: the Ray tests skip)
    pass


# --- the plan: one replica planned, the others derived --------------------------------------------------


def test_replica_plans_are_replica_zeros(llama_dir):
    one = make_plan(llama_dir, 2)
    plan = make_plan(llama_dir, mesh=Mesh(dp=3, tp=2))
    assert plan.mesh == Mesh(dp=3, tp=2) and len(plan.ranks) == 6
    for rp in plan.ranks:
        assert rp.rank == plan.ranks.index(rp) and rp.mesh == plan.mesh
        assert rp.tensors == one.ranks[rp.rank % 2].tensors, rp.rank
        assert rp.coords == {"dp": rp.rank // 2, "pp": 0, "tp": rp.rank % 2}
    assert "replicas 1-2 (4 rank(s)) copy the same shards" in plan.summary()
    assert plan.summary().splitlines()[-2] == one.summary().splitlines()[-1]  # storage is read by replica 0 only


def test_source_and_replica_arguments_are_checked(llama_dir):
    with pytest.raises(ConfigurationError, match="needs model_dir"):
        raylazy.load()
    with pytest.raises(ConfigurationError, match="dp=0"):
        raylazy.load(llama_dir, 2, replicas=0)
    with pytest.raises(ConfigurationError, match="replicas=2 or a mesh with dp=2, not both"):
        raylazy.load(llama_dir, mesh=Mesh(dp=2, tp=2), replicas=2)


# --- on a two-node cluster -----------------------------------------------------------------------------


class CountingLoader(Holder):
    """Counts its storage loads (`load`, `reload`) and the shard batches it served to a copying rank (`peer_shards`),
    and records its process's positional reads (`measured.SyscallLog`)."""

    def __init__(self, rank: int, device: str = "auto"):
        super().__init__(rank, device)
        self.loads, self.served, self.log = 0, 0, SyscallLog().install()

    def file_reads(self) -> list[tuple[str, int, int]]:
        """(path, start, end) of every positional read of the process since the last call."""
        reads, self.log.pread, self.log.preadv = self.log.pread + self.log.preadv, [], []
        return reads

    def load(self, plan, options, node_read=None):
        self.loads += 1
        return super().load(plan, options, node_read)

    def reload(self, plan, options, node_read=None):
        self.loads += 1
        return super().reload(plan, options, node_read)

    def peer_shards(self, names):
        self.served += 1
        return super().peer_shards(names)

    def counts(self) -> tuple[int, int]:
        return self.loads, self.served


class SlowSource(CountingLoader):
    """Serves each batch of shards slowly, so a test can kill it mid-copy."""

    def peer_shards(self, names):
        time.sleep(0.25)
        return super().peer_shards(names)


def _kill_when_serving(loaded, rank: int, batches: int) -> threading.Thread:
    """A thread killing `loaded`'s rank actor (for good) once it has served `batches` batches."""
    import ray

    actor = loaded.actors[rank]

    def kill():
        deadline = time.monotonic() + 120
        while ray.get(actor.counts.remote())[1] < batches and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(actor, no_restart=True)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def check_who_read(loaded, readers: set[int]) -> None:
    """Since the last check, the ranks in `readers` read at least their planned ranges of the checkpoint with
    positional reads (recorded in their processes, and their own `ReadStats.rchar`); the others read no byte of it."""
    import ray

    root = os.path.realpath(loaded.plan.root)
    got = ray.get([a.file_reads.remote() for a in loaded.actors], timeout=60)
    for rp, s, reads in zip(loaded.plan.ranks, loaded.stats, got):
        data = sum(end - start for path, start, end in reads if path.startswith(root))
        if rp.rank in readers:
            assert data >= rp.stats.bytes_read and s.rchar >= rp.stats.bytes_read, (rp.rank, data, s.rchar)
        else:
            assert data == 0, f"rank {rp.rank} read {data} bytes of the checkpoint"


def _load(model_dir, actor_cls=CountingLoader, **options):
    return raylazy.load(model_dir, use_gpu=True, device="cpu", progress=False, placement_timeout_s=120,
                        actor_cls=actor_cls, **options)


@pytest.mark.ray
class TestReplicas:
    def test_two_replicas_identical_and_storage_read_once(self, two_node_cluster, llama_dir):
        import ray

        before = live()
        loaded = _load(llama_dir, tp=2, replicas=2, backend="ranged")
        try:
            plan = loaded.plan
            assert loaded.mesh == [Coord(r, r // 2, 0, r % 2) for r in range(4)]
            shards = ray.get(loaded.refs(), timeout=120)
            for rp, s in zip(plan.ranks, shards):
                check_rank(rp, s, llama_dir)
            assert digest(shards[0]) == digest(shards[2]) and digest(shards[1]) == digest(shards[3])
            counts = ray.get([a.counts.remote() for a in loaded.actors])
            assert [c[0] for c in counts] == [1, 1, 0, 0], counts  # only replica 0 touched storage
            assert counts[0][1] > 0 and counts[1][1] > 0, counts     # ... and served replica 1
            st = loaded.stats
            check_who_read(loaded, {0, 1})
            assert [s.bytes_from_replica for s in st] == [0, 0] + [sum(t.nbytes for t in rp.tensors) for rp in plan.ranks[2:]]
            assert "x 2 replicas" in loaded.summary() and "copied from live replicas" in loaded.summary()
        finally:
            loaded.release()
        assert_no_leaks(before, "a replicated load")

    def test_reload_reads_storage_once_and_copies_into_the_replicas_shards(self, two_node_cluster, llama_dir,
                                                                          tmp_path):
        import ray

        other = build_checkpoint("llama", tmp_path / "llama_b", seed=7)
        with _load(llama_dir, tp=2, replicas=2, backend="ranged") as loaded:
            ptrs = ray.get(loaded.run(pointers), timeout=120)
            ray.get([a.hold.remote() for a in loaded.actors], timeout=60)  # the old tensors stay: their addresses too
            assert loaded.reload(other) is loaded
            for rp, s in zip(loaded.plan.ranks, ray.get(loaded.refs(), timeout=120)):
                check_rank(rp, s, other)
            assert ray.get(loaded.run(pointers), timeout=120) == ptrs, "a reload must not allocate, replicas included"
            counts = ray.get([a.counts.remote() for a in loaded.actors])
            assert [c[0] for c in counts] == [2, 2, 0, 0], counts  # replica 0 read both checkpoints, replica 1 none
            st = loaded.stats
            assert [s.backend for s in st[2:]] == ["replica"] * 2
            check_who_read(loaded, {0, 1})
            assert [s.bytes_from_replica for s in st[2:]] == [sum(t.nbytes for t in rp.tensors)
                                                              for rp in loaded.plan.ranks[2:]]

    def test_cli_load_with_replicas(self, two_node_cluster, llama_dir, capsys):
        from raylazy import cli

        before = live()
        assert cli.main(["load", llama_dir, "--tp", "2", "--replicas", "2", "--device", "cpu", "--backend", "ranged",
                         "--no-progress"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out.splitlines()
        head = out.index(next(line for line in out if line.split()[:2] == ["rank", "replica"]))
        rows = [line.split() for line in out[head + 1 : head + 5]]
        plan = raylazy.plan(llama_dir, 2)
        # rank, replica, stage, tp rank, ..., bytes needed, bytes from peers, ..., rchar: replica 1 copies all it
        # needs, replica 0's read calls returned at least its bytes
        assert out[head].split()[-1] == "rchar"
        for r, row in enumerate(rows):
            needed = plan.ranks[r % 2].stats.bytes_needed
            assert row[:4] == [str(r), str(r // 2), "0", str(r % 2)] and int(row[7]) == needed
            assert int(row[8]) == (needed if r >= 2 else 0), row
            assert r >= 2 or int(row[11]) >= needed, row
        assert "x 2 replicas" in out[head + 5]
        assert_no_leaks(before, "the command's replicated load")

    def test_peer_load_without_the_checkpoint(self, two_node_cluster, llama_dir, tmp_path):
        import ray

        model = shutil.copytree(llama_dir, tmp_path / "model")
        before = live()
        source = _load(str(model), tp=2)
        try:
            os.rename(model, tmp_path / "gone")  # the checkpoint is no longer reachable
            for transport in ("auto", "gloo"):  # the object store, and Ray's direct transport (NCCL's path on GPUs)
                copy = raylazy.load(source=source, use_gpu=True, device="cpu", progress=False, peer_transport=transport,
                                    actor_cls=CountingLoader)
                try:
                    assert copy.placement_group != source.placement_group and copy.plan.root == source.plan.root
                    check_who_read(copy, set())
                    assert all(s.bytes_from_replica == sum(t.nbytes for t in rp.tensors) > 0
                               for s, rp in zip(copy.stats, copy.plan.ranks))
                    for rp, s in zip(copy.plan.ranks, ray.get(copy.refs(), timeout=120)):
                        check_rank(rp, s, llama_dir)
                    assert [c[0] for c in ray.get([a.counts.remote() for a in copy.actors])] == [0, 0]
                finally:
                    copy.release()
            # released on its own: the source still serves its shards
            check_rank(source.plan.ranks[1], source.get(1), llama_dir)
        finally:
            source.release()
        assert_no_leaks(before, "a peer load")

    def test_source_killed_mid_copy_falls_back_to_storage(self, two_node_cluster, llama_dir):
        import ray

        before = live()
        source = _load(llama_dir, SlowSource, tp=2)
        try:
            killer = _kill_when_serving(source, 0, 2)
            copy = raylazy.load(source=source, use_gpu=True, device="cpu", progress=False, staging_budget=4096,
                                actor_cls=CountingLoader)
            killer.join()
            try:
                st = copy.stats
                # rank 0 read storage itself, once, its source dead; rank 1 copied from its live source
                assert [c[0] for c in ray.get([a.counts.remote() for a in copy.actors], timeout=60)] == [1, 0]
                check_who_read(copy, {0})
                assert st[0].backend == "ranged" and st[0].bytes_from_replica == 0     # nothing half-copied kept
                assert st[1].backend == "replica" and st[1].bytes_from_replica > 0
                for rp, s in zip(copy.plan.ranks, ray.get(copy.refs(), timeout=120)):
                    check_rank(rp, s, llama_dir)
            finally:
                copy.release()
        finally:
            source.release()
        assert_no_leaks(before, "a fallback to storage")

    def test_source_killed_mid_copy_without_the_checkpoint_is_one_error(self, two_node_cluster, llama_dir, tmp_path):
        model = shutil.copytree(llama_dir, tmp_path / "model")
        before = live()
        source = _load(str(model), SlowSource, tp=2)
        try:
            os.rename(model, tmp_path / "gone")
            killer = _kill_when_serving(source, 0, 2)
            with pytest.raises(PeerFailedError) as e:
                raylazy.load(source=source, use_gpu=True, device="cpu", progress=False, staging_budget=4096)
            killer.join()
            msg = str(e.value)
            assert "rank(s) 0 could not copy their shards from a live replica" in msg, msg
            assert f"reading them from storage ({model})" in msg and "ReadError" in msg, msg
        finally:
            source.release()
        assert_no_leaks(before, "a failed peer load")
