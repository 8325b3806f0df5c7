"""What the Ray tests share: loading with a test rank actor, checking ranks bit for bit against
safetensors, finding raylazy's live actors and placement groups, and waiting for them to go.

Functions defined here, in planlib.py and in measured.py travel to the rank actors by value
(`loaded.run(where_am_i)`): the workers need not import these files.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import raylazy
from raylazy.cluster.actor import RankLoader
from tests.support import measured, planlib
from tests.support.checkpoints import reference_tensors
from tests.support.expected import expected_rank, model_config
from tests.support.planlib import as_bytes

try:
    import ray.cloudpickle

    for _module in (sys.modules[__name__], planlib, measured):  # as_bytes and SyscallLog run in the actors too
        ray.cloudpickle.register_pickle_by_value(_module)
except Exception:  # noqa: BLE001  (Ray missing: the Ray tests skip)
    pass

#: The rank actors and placement group of a failed or released load must be gone within this many seconds.
GONE_WITHIN_S = 30.0


def load_with(actor_cls: type[RankLoader], model_dir: str, tp: int, **options) -> raylazy.LoadedModel:
    """raylazy.load with a RankLoader subclass of a test as the rank actor (the one use of the hook)."""
    return raylazy.load(model_dir, tp, actor_cls=actor_cls, **options)


# --- shards against the reference ------------------------------------------------------------------

_FULL: dict[str, dict] = {}


def full_tensors(model_dir: str) -> dict:
    """Every tensor of `model_dir` read by safetensors' get_tensor, read once per directory."""
    if model_dir not in _FULL:
        _FULL[model_dir] = reference_tensors(model_dir)
    return _FULL[model_dir]


def check_rank(plan_rank, shards: dict, model_dir: str) -> None:
    """Exactly the checkpoint's tensors, on the CPU, each equal bit for bit to the slice the rank's place gives it
    (`expected.expected_rank`: safetensors' get_tensor, chunked as vLLM shards these models), for a tp-only mesh
    with replicas: the tp rank is the rank's index within its replica (ranks are replica-major). The plan's
    tensors and pieces are not consulted: a planner giving ranks the wrong slices fails here."""
    mesh = plan_rank.mesh
    assert mesh.pp == 1, "check_rank knows tp-only meshes; tests/core/test_stages.py checks pipeline stages"
    want = expected_rank(full_tensors(model_dir), model_config(model_dir), plan_rank.rank % mesh.tp, mesh.tp)
    assert sorted(shards) == sorted(want), (
        f"rank {plan_rank.rank}: missing {sorted(set(want) - set(shards))}, extra {sorted(set(shards) - set(want))}"
    )
    for name, ref in want.items():
        got = shards[name]
        assert got.device.type == "cpu", name
        assert got.dtype == ref.dtype, (name, got.dtype, ref.dtype)
        assert tuple(got.shape) == tuple(ref.shape), (name, got.shape, ref.shape)
        assert as_bytes(got) == as_bytes(ref), f"rank {plan_rank.rank}: {name} differs from its slice of the tensor"


def check_ranks(plan, per_rank: list[dict], model_dir: str) -> None:
    """check_rank for every rank of `plan`, given each rank's {name: tensor}."""
    assert len(per_rank) == len(plan.ranks)
    for rp, shards in zip(plan.ranks, per_rank):
        check_rank(rp, shards, model_dir)


def check_loaded(loaded, model_dir: str) -> None:
    """check_rank for every rank of a load, its shards fetched through refs()."""
    import ray

    check_ranks(loaded.plan, ray.get(loaded.refs(), timeout=120), model_dir)


def digest(shards: dict) -> str:
    """sha256 of a rank's names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for name in sorted(shards):
        h.update(name.encode())
        h.update(str(shards[name].dtype).encode())
        h.update(str(tuple(shards[name].shape)).encode())
        h.update(as_bytes(shards[name]))
    return h.hexdigest()


def pointers(rank: int, shards: dict) -> dict:
    """Run in a rank (`loaded.run`): each shard tensor's data_ptr. Compare two calls only while something holds the
    first call's tensors (`Holder.hold`): the allocator may give freed memory's addresses to new tensors."""
    return {name: t.data_ptr() for name, t in shards.items()}


class Holder(RankLoader):
    """A rank that keeps a consumer's reference to its tensors (as a model built on them would): `hold()`."""

    def hold(self) -> None:
        self.held = dict(self.shards())

    def held_digest(self) -> str:
        return digest(self.held)


def where_am_i(rank: int, shards: dict) -> dict:
    """Run inside a rank actor (`loaded.run(where_am_i)`): who runs it and what it holds."""
    import ray

    return {
        "rank": rank,
        "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpu_ids": tuple(str(g) for g in ray.get_gpu_ids()),
        "digest": digest(shards),
        "devices": sorted({str(t.device) for t in shards.values()}),
    }


# --- raylazy's actors and placement groups in the cluster ------------------------------------------


def actor_ids(loaded) -> set[str]:
    """The Ray actor ids (hex) of a load's rank actors."""
    return {a._actor_id.hex() for a in loaded.actors}


def raylazy_actors() -> dict[str, str]:
    """actor id -> state of every raylazy rank actor (named raylazy-<id>-rank<r>) of the connected cluster.

    Read from the GCS tables, not `ray.util.state`: that API goes through the dashboard,
    which the test clusters do not start (and on a shared machine it could even reach
    another cluster's dashboard on the default port).
    """
    import ray._private.state as state

    return {aid: a["State"] for aid, a in state.actors().items() if (a.get("Name") or "").startswith("raylazy-")}


def raylazy_groups() -> dict[str, str]:
    """placement group id -> state of every raylazy placement group of the connected cluster."""
    import ray

    return {
        pid: g["state"] for pid, g in ray.util.placement_group_table().items() if (g.get("name") or "").startswith("raylazy-")
    }


def live() -> tuple[set, set]:
    """(ids of raylazy actors not DEAD, ids of raylazy placement groups not REMOVED); pending ones count too."""
    actors = {a for a, s in raylazy_actors().items() if s != "DEAD"}
    groups = {g for g, s in raylazy_groups().items() if s != "REMOVED"}
    return actors, groups


def wait_for(predicate, timeout_s: float, what: str):
    """predicate()'s first truthy value, polled every 50 ms; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def assert_no_leaks(before: tuple[set, set], what: str) -> None:
    """Within GONE_WITHIN_S, no raylazy actor or placement group is alive beyond those in `before` (a `live()`)."""

    def gone():
        actors, groups = live()
        return not (actors - before[0]) and not (groups - before[1])

    try:
        wait_for(gone, GONE_WITHIN_S, f"the actors and placement groups of {what} to go")
    except AssertionError:
        actors, groups = live()
        raise AssertionError(f"after {what}: still alive: actors {sorted(actors - before[0])}, "
                             f"groups {sorted(groups - before[1])}") from None
