"""Smoke test of benchmarks/plan_405b.py at 2 layers and 5 files, so the harness cannot rot."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from raylazy.planning import make_plan
from tests.support import REPO

_PATH = os.path.join(str(REPO), "benchmarks", "plan_405b.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("plan_405b", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sparse_checkpoint_is_a_valid_405b_slice(bench, tmp_path):
    info = bench.write_checkpoint(str(tmp_path), layers=2, num_files=5)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    assert names == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert info["tensors"] == 2 * 9 + 3 and info["files"] == 5
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names)
    assert index["metadata"]["total_size"] == info["data_bytes"]
    total = sum(os.path.getsize(tmp_path / n) for n in names)
    assert total == info["data_bytes"] + info["header_bytes"]
    assert sum(os.stat(tmp_path / n).st_blocks * 512 for n in names) < total / 1000, "files should be sparse"

    plan = make_plan(str(tmp_path), 8)
    assert plan.checkpoint_bytes == info["data_bytes"]
    q = next(t for t in plan.ranks[3].tensors if t.name == "model.layers.1.self_attn.q_proj.weight")
    assert q.full_shape == (16384, 16384) and q.pieces == ((3 * 2048, 0, 2048),)
    k = next(t for t in plan.ranks[3].tensors if t.name == "model.layers.1.self_attn.k_proj.weight")
    assert k.pieces == ((3 * 128, 0, 128),)  # 8 kv heads over tp=8: one each
    down = next(t for t in plan.ranks[3].tensors if t.name == "model.layers.0.mlp.down_proj.weight")
    assert down.shape == (16384, 6656) and down.reads[0].count == 16384


def test_benchmark_runs_and_reads_only_headers(bench, capsys):
    assert bench.main(["--layers", "2", "--files", "5", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "21 tensors in 5 files" in out and "PASS" in out
    for rank in range(8):
        assert re.search(rf"^\s+{rank}\s+21\s", out, re.M)
    m = re.search(r"bytes read while planning \(rchar\)\s+([\d,]+)\s+expected ([\d,]+)", out)
    assert m, out
    if os.path.exists("/proc/self/io"):
        assert m.group(1) == m.group(2)


def test_deepseek_benchmark_runs_and_reads_only_headers(capsys):
    """benchmarks/plan_deepseek.py at 5 layers (3 dense, 2 MoE of 256 experts): tp=4 x pp=2, expert parallel."""
    spec = importlib.util.spec_from_file_location("plan_deepseek", _PATH.replace("plan_405b.py", "plan_deepseek.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--layers", "5", "--files", "7", "--tp", "4", "--runs", "1", "--fresh", "1"]) == 0
    out = capsys.readouterr().out
    assert "tp=4 x pp=2, expert parallel" in out and "PASS" in out
    assert re.search(r"a fresh process's first call, the slowest\s+[\d.]+ ms\s+each of 1: ", out), out
    for rank in range(8):  # stage 0: layers 0-2 (dense), stage 1: layers 3-4, each rank 64 of 256 experts
        assert re.search(rf"^\s+{rank}\s+{rank // 4}\s+{rank % 4}\s", out, re.M), out
    m = re.search(r"bytes read while planning \(rchar\)\s+([\d,]+)\s+expected ([\d,]+)", out)
    assert m, out
    if os.path.exists("/proc/self/io"):
        assert m.group(1) == m.group(2)
