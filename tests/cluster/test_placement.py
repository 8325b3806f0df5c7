"""Placement: requests that can never be placed fail at once; a local Ray raylazy starts shares its CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import raylazy
from raylazy.cluster.bundles import can_ever_place, cpu_share, node_capacity
from raylazy.errors import PlacementError

ONE_CPU, GPU = {"CPU": 1.0}, {"CPU": 1.0, "GPU": 1}


@pytest.mark.parametrize(
    "bundles, nodes, strategy, ok",
    [
        ([ONE_CPU] * 4, [{"CPU": 2}, {"CPU": 2}], "PACK", True),
        ([ONE_CPU] * 5, [{"CPU": 2}, {"CPU": 2}], "PACK", False),
        ([ONE_CPU] * 4, [{"CPU": 2}, {"CPU": 2}], "STRICT_PACK", False),
        ([ONE_CPU] * 2, [{"CPU": 2}, {"CPU": 2}], "STRICT_PACK", True),
        ([ONE_CPU] * 2, [{"CPU": 8}], "STRICT_SPREAD", False),
        ([ONE_CPU] * 2, [{"CPU": 1}, {"CPU": 1}], "STRICT_SPREAD", True),
        ([ONE_CPU] * 3, [{"CPU": 1}, {"CPU": 1}], "SPREAD", False),
        ([GPU] * 2, [{"CPU": 8}], "PACK", False),  # no GPU anywhere
        ([GPU] * 8, [{"CPU": 4, "GPU": 8}], "PACK", False),  # the CPUs run out first
        ([GPU] * 8, [{"CPU": 16, "GPU": 8}], "STRICT_PACK", True),
        ([{"CPU": 0.25}] * 8, [{"CPU": 2}], "STRICT_PACK", True),
        ([ONE_CPU], [], "PACK", False),
    ],
)
def test_can_ever_place(bundles, nodes, strategy, ok):
    assert can_ever_place(bundles, nodes, strategy) is ok


TWO_BY_2, ONE_BY_4 = [{"CPU": 2, "GPU": 2}] * 2, [{"CPU": 4, "GPU": 4}]


@pytest.mark.parametrize(
    "ranks, groups, nodes, strategy, ok",  # one placement group per pipeline stage, ranks / groups each
    [
        (4, 2, TWO_BY_2, "STRICT_PACK", True),  # a stage per node
        (4, 2, ONE_BY_4, "STRICT_PACK", True),  # both stages on the one node
        (6, 3, TWO_BY_2, "STRICT_PACK", False),  # three stages, two nodes that hold one each
        (4, 2, [{"CPU": 3, "GPU": 3}, {"CPU": 1, "GPU": 1}], "STRICT_PACK", False),  # 4 GPUs, but one stage fits
        (4, 2, TWO_BY_2, "STRICT_SPREAD", True),
        (4, 2, ONE_BY_4, "STRICT_SPREAD", False),
    ],
)
def test_can_ever_place_stages(ranks, groups, nodes, strategy, ok):
    assert can_ever_place([GPU] * ranks, nodes, strategy, groups) is ok


@pytest.mark.parametrize("cpus, tp", [(2, 8), (2, 3), (2, 1), (16, 8), (1, 7)])
def test_cpu_share_fits_every_rank(cpus, tp):
    share = cpu_share(cpus, tp)
    assert 0 < share <= 1 and node_capacity({"CPU": cpus}, {"CPU": share}) >= tp
    assert share == 1 or share * tp > cpus - 0.001 * tp  # no more than Ray's rounding is left unused


def _groups() -> set:
    import ray

    return set(ray.util.placement_group_table())


@pytest.mark.ray
@pytest.mark.parametrize(
    "kwargs, asked",
    [
        (dict(cpus_per_rank=100), "100 CPU"),
        (dict(use_gpu=True), "1 GPU"),
        (dict(placement_strategy="STRICT_SPREAD"), "STRICT_SPREAD"),
    ],
)
def test_a_request_that_can_never_be_placed_fails_at_once(llama_dir, ray_local, kwargs, asked):
    import ray

    from raylazy.cluster.ray_internals import autoscaler_can_add_nodes

    assert not autoscaler_can_add_nodes()  # a local Ray runs Ray's read-only autoscaler
    before, t0 = _groups(), time.monotonic()
    with pytest.raises(PlacementError) as info:
        raylazy.load(llama_dir, 2, device="cpu", progress=False, placement_timeout_s=300, **kwargs)
    assert time.monotonic() - t0 < 10
    msg = str(info.value)
    assert "2 rank(s)" in msg and asked in msg and "can never be placed" in msg
    assert f"{ray.cluster_resources()['CPU']:g} CPU" in msg  # what exists
    assert _groups() == before  # nothing was created


@pytest.mark.own_processes  # raylazy's own Ray
@pytest.mark.slow
def test_embedded_default_loads_any_tp_on_two_cores(tmp_path):
    """The README's quick start, `raylazy load --tp 4` with no cluster: raylazy's own local Ray shares 2 CPUs among
    4 ranks."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # raylazy then starts a Ray of its own
    run = subprocess.run([sys.executable, "-m", "raylazy.cli", "load", "--tp", "4", "--no-progress"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(4)), run.stdout
    assert "tp=4" in run.stderr + run.stdout

