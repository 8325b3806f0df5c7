"""The layouts the projections (benchmarks/estimate_projections.py) plan are the published models' sizes, and a
small one of them is planned and estimated end to end, so the harness cannot rot."""

from __future__ import annotations

import math

import pytest

_BYTES = {"F8_E4M3": 1, "F32": 4, "BF16": 2}


@pytest.fixture(scope="module")
def proj():
    from benchmarks import estimate_projections  # (it puts benchmarks/ on sys.path for plan_405b, plan_deepseek)

    return estimate_projections


def _size(specs) -> tuple[float, float]:
    """(parameters, bytes) of a layout: weights without their block scales, and every tensor's bytes."""
    params = sum(math.prod(s[1]) for s in specs if not s[0].endswith("_scale_inv"))
    return params, sum(math.prod(s[1]) * _BYTES[s[2] if len(s) > 2 else "BF16"] for s in specs)


def test_the_layouts_are_the_published_sizes(proj):
    ds = proj.plan_deepseek
    params, nbytes = _size(ds.tensor_specs())
    assert round(nbytes / 1e9, 1) == 688.6  # DeepSeek-V3/R1 as released (the 688.6 GB)
    assert abs(params / 685e9 - 1) < 0.005  # 671 B + 14 B of the multi-token-prediction layer
    k = proj.KIMI_K2
    params, nbytes = _size(ds.tensor_specs(k["num_hidden_layers"], k["n_routed_experts"], "fp8", k))
    assert abs(params / 1e12 - 1) < 0.05  # Kimi-K2: 1 T parameters, as its model card gives them


def test_a_small_deepseek_is_projected(proj, tmp_path):
    ds = proj.plan_deepseek
    ds.write_checkpoint(str(tmp_path), layers=4, num_files=5)
    plan = proj._plan(str(tmp_path), "anchor-50gbps", 4, expert_parallel=True)
    rows = [{"name": "small", "hardware": "anchor-50gbps", "estimates": proj.compare(plan, "anchor-50gbps"),
             "published": proj.ANCHORS_R1}]
    text = proj.report(rows)
    assert "| raylazy |" in text and "| vllm |" in text and "InstantTensor: 15.3 s" in text
