"""Loads side by side on one cluster complete or wait for capacity, and each releases only what it holds."""

from __future__ import annotations

import contextlib

import pytest
import torch

import raylazy
from tests.support.planlib import as_bytes
from tests.support.raytest import (
    assert_no_leaks,
    check_loaded,
    check_rank,
    live,
    raylazy_groups,
    wait_for,
)


@pytest.mark.ray
def test_concurrent_loads_complete_or_wait_and_release_independently(llama_dir, qwen2_dir, ray_local):
    """Three loads at once on 8 CPUs: llama tp=2 (2 CPUs), qwen2 tp=2 (2 CPUs), llama again tp=2 with
    2.5 CPUs a rank (5 CPUs): 9 CPUs asked, so one waits until another is released."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    before = live()
    specs = {"llama": (llama_dir, 1.0), "qwen2": (qwen2_dir, 1.0), "llama-big": (llama_dir, 2.5)}
    assert ray.cluster_resources()["CPU"] < 9
    # placement groups of earlier tests are removed asynchronously: wait for their CPUs to come back
    wait_for(lambda: ray.available_resources().get("CPU", 0) >= 8, 60, "the CPUs of earlier loads")
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {pool.submit(raylazy.load, d, 2, device="cpu", progress=False, cpus_per_rank=cpus,
                           placement_timeout_s=240, timeout_s=240): name for name, (d, cpus) in specs.items()}
    loaded: dict = {}

    def finished():
        done = [f for f in futures if f.done()]
        return done if len(done) >= 2 else None

    try:
        # any two fit (2 + 2 or 2 + 5 CPUs), the three do not: two finish while the third waits, its
        # placement group pending
        done = wait_for(finished, 240, "two of the loads")
        waiting = set(futures) - set(done)
        assert len(waiting) == 1, "with 9 CPUs asked of 8, one load must wait"
        (third,) = waiting
        wait_for(lambda: {g for g, state in raylazy_groups().items() if state == "PENDING"} - before[1], 30,
                 "the third load's placement group to wait for CPUs")
        assert not third.done(), "with 9 CPUs asked of 8, one load must wait"
        for f in done:
            loaded[futures[f]] = f.result()
        first = next(iter(loaded))
        check_loaded(loaded[first], specs[first][0])
        loaded[first].release()  # frees enough for the waiting load
        loaded[futures[third]] = third.result(timeout=240)
        others = [n for n in loaded if n != first]
        for n in others:
            check_loaded(loaded[n], specs[n][0])
        # releasing one does not disturb the other: its actors still hold their shards
        loaded[others[0]].release()
        keep = loaded[others[1]]
        inside = ray.get(keep.run(lambda rank, shards: {k: as_bytes(v) for k, v in shards.items()}), timeout=60)
        for rp, got in zip(keep.plan.ranks, inside):
            check_rank(rp, {t.name: _typed(got[t.name], t) for t in rp.tensors}, specs[others[1]][0])
    finally:
        for f in futures:
            with contextlib.suppress(Exception):
                loaded.setdefault(futures[f], f.result(timeout=300))
        for m in loaded.values():
            m.release()
        pool.shutdown()
    assert_no_leaks(before, "concurrent loads")


def _typed(data: bytes, shard) -> torch.Tensor:
    from raylazy.core.dtypes import torch_dtype

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype(shard.dtype)).reshape(shard.shape)


