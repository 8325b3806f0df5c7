"""Where ranks may go: joining or starting Ray, each rank's bundle, and whether a cluster can ever hold them.

Before anything is created, the request is checked against the nodes the cluster
has: one that can never be placed (a bundle larger than every node, more bundles
than the nodes hold, STRICT_SPREAD over too few nodes) fails at once with a
`PlacementError`, unless an autoscaler could add nodes; only then does the load
wait up to `placement_timeout_s`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence

from ..core.options import PlacementOptions
from ..errors import PlacementError
from .ray_internals import autoscaler_can_add_nodes

#: GCS address of the local Ray that `ensure_ray` started in this process, if any.
_started_gcs: str | None = None
#: What every rank actor imports, imported by the workers of a Ray that raylazy starts as they start (Ray's
#: `preload_python_modules`), so an actor's process has torch ready when it is asked to be a rank.
PRELOAD = ("torch", "raylazy.io.backends")


def worker_config(cpus: int | None = None) -> dict:
    """The `_system_config` of the local Ray raylazy starts: its workers import `PRELOAD` as they start, and up to
    `cpus` (default: this machine's CPUs) idle ones are kept however many CPUs are reserved. Ray's default keeps as
    many as there are CPUs free, so a load's placement group, reserving every CPU of a Ray raylazy started, had
    Ray end the workers it started ahead (torch imported) just before the ranks' actors would have taken them."""
    return {"preload_python_modules": list(PRELOAD), "num_workers_soft_limit": cpus or os.cpu_count() or 1}


def ensure_ray() -> bool:
    """Use the Ray this process has initialised, else the cluster RAY_ADDRESS names, else start a local Ray of
    our own (never joining a cluster by guessing), with `worker_config` (its workers import `PRELOAD` as they
    start) and without the dashboard: its processes would start beside the ranks' for a Ray that lives as long as
    this process (about 1 s of a 2-core machine's quick start), and Ray's shutdown kills them before they clean up.
    Returns True when the Ray in use is a local one that raylazy started: its CPUs are then ours to share among
    the ranks."""
    global _started_gcs
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or "local"
        starting = {"_system_config": worker_config(), "include_dashboard": False} if address == "local" else {}
        ray.init(address=address, logging_level=logging.WARNING, **starting)
        if address == "local":
            _started_gcs = ray.get_runtime_context().gcs_address
    return _started_gcs is not None and _started_gcs == ray.get_runtime_context().gcs_address


def rank_bundles(ranks: int, opts: PlacementOptions, own_ray: bool) -> list[dict]:
    """One bundle per rank: a GPU each when `use_gpu` (None: when the device is not the CPU and the cluster has
    GPUs; logical GPUs are fine), and `cpus_per_rank` CPUs (None: 1, or an equal share of a local Ray that
    raylazy started, since ranks are processes, not cores)."""
    import ray

    use_gpu = opts.use_gpu if opts.use_gpu is not None else (opts.device != "cpu" and cluster_has_gpus())
    cpus = opts.cpus_per_rank
    if cpus is None:
        cpus = cpu_share(ray.cluster_resources().get("CPU", 0), ranks) if own_ray else 1.0
    bundle = {"CPU": cpus} if cpus else {}
    if use_gpu:
        bundle["GPU"] = 1
    return [dict(bundle) for _ in range(ranks)]


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1


#: Ray accounts resources in units of 1/10000 (fractional CPUs and GPUs).
_RESOURCE_UNIT = 10_000


def cpu_share(total_cpus: float, ranks: int) -> float:
    """CPUs per rank so that `ranks` ranks (every rank of the mesh: tp x pp x replicas) fit in `total_cpus` (at
    most 1), rounded down to Ray's unit."""
    return min(1.0, math.floor(total_cpus * _RESOURCE_UNIT / ranks) / _RESOURCE_UNIT)


def node_capacity(node: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many copies of `bundle` a node with these total resources holds."""
    need = {k: round(v * _RESOURCE_UNIT) for k, v in bundle.items() if v > 0}
    if not need:
        return 1 << 30
    return min(round(node.get(k, 0) * _RESOURCE_UNIT) // v for k, v in need.items())


def can_ever_place(bundles: Sequence[Mapping[str, float]], nodes: Sequence[Mapping[str, float]], strategy: str,
                   groups: int = 1) -> bool:
    """Whether equal `bundles`, as `groups` placement groups of consecutive bundles each under `strategy`, fit on
    nodes with these total resources once all is free."""
    caps = [node_capacity(n, bundles[0]) for n in nodes] if bundles else []
    size = len(bundles) // groups
    if strategy == "STRICT_PACK":  # each group on one node
        return sum(c // size for c in caps) >= groups if size else True
    if strategy == "STRICT_SPREAD":  # each group on `size` distinct nodes
        return sum(c >= 1 for c in caps) >= size and sum(min(c, groups) for c in caps) >= len(bundles)
    return sum(caps) >= len(bundles)


def stage_strategy(bundles: list[dict], opts: PlacementOptions, stages: int) -> str:
    """The strategy of each pipeline stage's placement group: `placement_strategy` when given (or with one
    stage); by default STRICT_PACK when the nodes can hold every stage on one node each (a stage's tp ranks
    together, as vLLM's Ray executor packs a tp group; the stages land on nodes of their own when a stage
    fills a node), else PACK."""
    import ray

    if stages == 1 or "placement_strategy" in opts.model_fields_set:
        return opts.placement_strategy
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return "STRICT_PACK" if can_ever_place(bundles, nodes, "STRICT_PACK", stages) else opts.placement_strategy


def check_placeable(bundles: list[dict], strategy: str, autoscale: bool | None, groups: int = 1) -> None:
    """Raise PlacementError at once when the cluster can never place `bundles` (as `groups` placement groups)
    and no autoscaler may help.

    autoscale: True always lets the caller wait (an autoscaler will add nodes), False never
    does, None asks `autoscaler_can_add_nodes()`.
    """
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if can_ever_place(bundles, nodes, strategy, groups):
        return
    if autoscale if autoscale is not None else autoscaler_can_add_nodes():
        return
    per_node = "; ".join(describe_resources(n) for n in nodes) or "no nodes"
    stages = f" in {groups} groups (one per pipeline stage)" if groups > 1 else ""
    raise PlacementError(
        f"{len(bundles)} rank(s) of {describe_resources(bundles[0])} each ({strategy}{stages}) can never be placed: the cluster's "
        f"{len(nodes)} node(s) have {per_node}, and no autoscaler can add nodes. Lower tp, pass use_gpu=False or a "
        "smaller cpus_per_rank, change placement_strategy, or add nodes (autoscale=True waits up to "
        "placement_timeout_s for nodes to join)"
    )


def describe_resources(res: Mapping[str, float]) -> str:
    """"2 CPU, 1 GPU": the CPUs and GPUs of a resource map (else its first keys)."""
    keys = [k for k in ("CPU", "GPU") if k in res] or sorted(res)[:3]
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in keys) or "nothing"
