"""Reserve one bundle per rank in a placement group and start a rank actor in each."""

from __future__ import annotations

import uuid

from .errors import PlacementError


def rank_bundles(tp: int, use_gpu: bool, cpus_per_rank: float) -> list[dict]:
    """One bundle per rank: a GPU each when asked, CPUs otherwise (logical resources are fine)."""
    bundle = {"CPU": cpus_per_rank} if cpus_per_rank else {}
    if use_gpu:
        bundle["GPU"] = 1
    return [dict(bundle) for _ in range(tp)]


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1


def start_ranks(actor_cls, tp: int, device: str, use_gpu: bool, cpus_per_rank: float, strategy: str,
                max_retries: int):
    """Create the placement group and one actor per bundle; returns (placement group, actors, name).

    The actors start (and import torch) as soon as the group is placed, while the
    caller goes on planning.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = f"raylazy-{uuid.uuid4().hex[:8]}"
    bundles = rank_bundles(tp, use_gpu, cpus_per_rank)
    try:
        pg = placement_group(bundles, strategy=strategy, name=name)
    except BaseException:  # a KeyboardInterrupt can land once the group exists but before it is returned
        try:
            remove_placement_group(ray.util.get_placement_group(name))
        except Exception:  # noqa: BLE001  (it was not created)
            pass
        raise
    # Direct transports (cuda_ipc, gloo, nccl) in LoadedModel.refs() need tensor transport enabled on the class.
    remote_cls = ray.remote(enable_tensor_transport=True)(actor_cls)
    create = (
        remote_cls.options(
            name=f"{name}-rank{r}",
            num_cpus=bundles[r].get("CPU", 0),
            num_gpus=bundles[r].get("GPU", 0),
            max_concurrency=4,  # progress() and shards() answer while load() runs
            max_restarts=max_retries,
            max_task_retries=max_retries,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=r
            ),
        ).remote(r, device)
        for r in range(tp)
    )
    try:
        actors = list(create)
    except BaseException:  # e.g. a KeyboardInterrupt: removing the group also kills the actors already created
        remove_placement_group(pg)
        raise
    return pg, actors, name


def wait_placed(pg, tp: int, bundles_desc: str, timeout_s: float) -> None:
    """Wait until the group is placed, or raise PlacementError saying what was asked and what exists."""
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise PlacementError(
            f"could not place {tp} rank(s) ({bundles_desc}) within {timeout_s:.0f} s; the cluster has "
            f"{_resources(ray.cluster_resources())} in all and {_resources(ray.available_resources())} free. "
            "Add nodes, lower tp, or pass use_gpu=False / a smaller cpus_per_rank"
        )


def _resources(res: dict) -> str:
    keys = [k for k in ("CPU", "GPU") if k in res] or sorted(res)[:3]
    return ", ".join(f"{res.get(k, 0):g} {k}" for k in keys) or "nothing"
