"""vLLM's in-place reload (`reload_weights(weights_path=..., is_checkpoint_format=True)`) of an engine loaded with
load_format="raylazy" (raylazy.integrations.reload), on CPU with vLLM's CPU build (its virtualenv:
tests/integrations/test_vllm.py's `vllm_python`).

One subprocess (tests/support/vllm/reloads.py) starts the engines in turn and reloads them step after step, as an RL
framework does. The oracles are vLLM's own: an engine started fresh on vLLM's default loader on the step's
checkpoint (its prompt logprobs, bit for bit), and in every worker a fresh model loaded by vLLM's default loader
from the checkpoint the engine now names (its parameters, bit for bit, against the engine's as its weight loaders
wrote them, before vLLM's CPU processing repacks them); and each worker's /proc/self/io (rchar) during the reload.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from tests.integrations.test_vllm import _metadata_bytes, vllm_python  # noqa: F401  (a fixture)
from tests.support import REPO
from tests.support.checkpoints import build_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42, 9, 8, 7]]
#: A batch of 64 KiB: the Llama's 0.85 MB are read in many batches (a fault can strike between them).
SMALL_BATCHES = {"backend": "ranged", "batch_bytes": 65536}

pytestmark = [pytest.mark.own_processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict[str, str]:
    """The checkpoints a trainer writes: the Llama at three steps (one more with a file truncated), the
    Qwen3-MoE with its experts fused on disk, then per expert (another layout) at two steps."""
    root = tmp_path_factory.mktemp("reload")
    out = {f"llama{s}": build_checkpoint("vllm-llama", root / f"llama{s}", dtype=torch.bfloat16,
                                         max_shard_size="200KB", seed=s) for s in range(3)}
    out["moe0"] = build_checkpoint("vllm-qwen3moe", root / "moe0", dtype=torch.bfloat16, in_memory=True)
    for s in (1, 2):
        out[f"moe{s}"] = build_checkpoint("vllm-qwen3moe", root / f"moe{s}", dtype=torch.bfloat16,
                                          max_shard_size="200KB", seed=s)
    shutil.copytree(out["llama2"], root / "truncated")
    last = sorted(p for p in os.listdir(root / "truncated") if p.endswith(".safetensors"))[-1]
    os.truncate(root / "truncated" / last, os.path.getsize(root / "truncated" / last) - 100)
    return out | {"truncated": str(root / "truncated"), "missing": str(root / "missing")}


def _runs(m: dict[str, str]) -> list[dict]:
    llama = [{"path": m["llama1"], "weights": True}, {"path": m["missing"]}, {"path": m["truncated"]},
             {"path": m["llama2"], "fault": 3, "weights": True}, {"path": m["llama2"], "weights": True},
             {"path": m["llama1"]}]
    tp2 = [{"path": m["llama1"], "weights": True},
           {"path": m["llama2"], "weights": True, "extra": {"backend": "exchange"}}]
    moe = [{"path": m["moe1"], "weights": True, "extra": {"warm_copies": False}}, {"path": m["moe2"], "weights": True},
           {"path": m["moe1"], "weights": True, "extra": {}}]
    raylazy = {"format": "raylazy", "extra": {"backend": "ranged"}}
    return [{"model": m["llama0"], "tp": 1, **raylazy, "extra": SMALL_BATCHES, "steps": llama},
            {"model": m["llama1"], "tp": 1, "format": "auto"},
            {"model": m["llama0"], "tp": 2, "bind": "0|1", **raylazy, "steps": tp2},
            {"model": m["llama2"], "tp": 2, "bind": "0|1", "format": "auto"},
            {"model": m["moe0"], "tp": 2, "bind": "0|1", "format": "raylazy", "steps": moe}]  # the default backend


@pytest.fixture(scope="module")
def runs(vllm_python, steps) -> list[dict]:  # noqa: F811  (the fixture imported above)
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1")
    out = subprocess.run([vllm_python, str(REPO / "tests" / "support" / "vllm" / "reloads.py"), "--runs",
                          json.dumps(_runs(steps)), "--prompts", json.dumps(PROMPTS)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=850).stdout
    results = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(_runs(steps)), out[-5000:]
    return results


def _same_weights(step: dict) -> None:
    """Every rank's parameters as the reload's weight loaders wrote them are a fresh default load's, bit for bit."""
    for rank, (mine, ref) in enumerate(zip(step["loaded"], step["fresh"], strict=True)):
        assert len(ref) > 10 and [n for n in ref if mine[n] != ref[n]] == [], rank


def _reads_its_bytes(step: dict, model_dir: str) -> None:
    """Each worker's read calls during the reload returned at least its need (its parameters' elements x 2 bytes,
    bfloat16 on disk) and at most 1.05 x beyond the checkpoint's metadata."""
    meta = _metadata_bytes(model_dir) + 4096
    for rank, (line, numel) in enumerate(zip(step["lines"], step["numel"], strict=True)):
        assert numel * 2 <= line["rchar"] <= 1.05 * numel * 2 + meta, (rank, numel * 2, line["rchar"], meta)


def test_reload_at_tp1_is_a_fresh_engine_on_the_new_checkpoint(runs, steps):
    """The reload changes the logprobs to those of an engine started on the new checkpoint, bit for bit; the
    weights are the default loader's; the worker read only its bytes, with the first load's recording."""
    first, fresh = runs[0], runs[1]
    step = first["steps"][0]
    assert step["error"] is None and step["logprobs"] != first["logprobs"]
    assert step["logprobs"] == fresh["logprobs"]
    _same_weights(step)
    _reads_its_bytes(step, steps["llama1"])
    assert step["lines"][0]["mode"] == "reload-reused" and step["lines"][0]["unplanned_regions"] == 0
    assert step["lines"][0]["batches"] > 3


def test_reload_at_tp2_reads_each_workers_regions_and_the_nodes_union_once(runs, steps):
    """tp=2, ranged: each worker reads only its half; with the exchange the node's union is read once (the workers'
    reads add up to it), and after both reloads the engine's logprobs are a fresh tp=2 engine's."""
    ranged, exchange = runs[2]["steps"]
    for step in (ranged, exchange):
        assert step["error"] is None
        _same_weights(step)
    _reads_its_bytes(ranged, steps["llama1"])
    assert [line["backend"] for line in ranged["lines"]] == ["ranged"] * 2
    assert [line["backend"] for line in exchange["lines"]] == ["exchange"] * 2
    union = exchange["lines"][0]["node_bytes"]
    assert union == exchange["lines"][1]["node_bytes"] > 0
    assert sum(line["planned_bytes_read"] for line in exchange["lines"]) == union
    assert ranged["logprobs"] != runs[2]["logprobs"] and exchange["logprobs"] != ranged["logprobs"]
    assert exchange["logprobs"] == runs[3]["logprobs"]


def test_a_changed_layout_is_recorded_afresh_then_reused_and_a_warm_one_copied_at_once(runs):
    """Qwen3-MoE at tp=2 (the default backend: copied out of the files' mappings), its experts fused on disk,
    reloaded from a checkpoint with one tensor per expert, recording (`warm_copies=false`): that reload records
    afresh (each region read as taken), the next one reuses it; then, the option back to its default, the first
    of the two, in the page cache, is copied at once out of its files' mappings. The weights are the default
    loader's each time and the logprobs change each step, back to the first step's on the third."""
    run = runs[4]
    afresh, reused, at_once = run["steps"]
    for step in (afresh, reused, at_once):
        assert step["error"] is None
        _same_weights(step)
    assert [line["mode"] for line in afresh["lines"]] == ["reload-recorded"] * 2
    assert [line["mode"] for line in reused["lines"]] == ["reload-reused"] * 2
    assert [line["mode"] for line in at_once["lines"]] == ["reload-at-once"] * 2
    assert [line["backend"] for line in afresh["lines"] + reused["lines"] + at_once["lines"]] == ["cooperative"] * 6
    assert all(line["unplanned_regions"] == 0 for line in reused["lines"])
    assert all(line["opaque_regions"] == 0 and line["in_place_bytes"] > 0 for line in at_once["lines"])
    assert run["logprobs"] != afresh["logprobs"] != reused["logprobs"]
    assert at_once["logprobs"] == afresh["logprobs"]


def test_a_bad_checkpoint_is_refused_before_any_weight_is_written(runs):
    """A missing directory, a truncated file: the reload raises before vLLM writes a weight and the engine
    serves on as before, its logprobs unchanged."""
    good, missing, truncated = runs[0]["steps"][:3]
    for step, what in ((missing, "missing"), (truncated, "truncated")):
        assert "before any weight was written" in step["error"], (what, step["error"])
        assert step["logprobs"] == good["logprobs"], what


def test_a_failure_while_writing_says_to_reload_and_the_next_reload_restores_the_model(runs):
    """A read failing mid-reload raises one error saying the engine needs another reload, and leaves each
    parameter either as the reload wrote it or as the engine held it before (vLLM's fallback for a layer that
    loaded nothing), never fresh memory; the next reload leaves every weight as a fresh load's, and a reload back
    to the first step gives that step's logprobs again."""
    good, _, _, failed, again, back = runs[0]["steps"]
    assert "reload again before serving" in failed["error"] and "injected" in failed["error"]
    held, written, mixed = good["now"][0], again["loaded"][0], failed["loaded"][0]
    kept = [n for n in held if mixed[n] == held[n] != written[n]]
    new = [n for n in held if mixed[n] == written[n] != held[n]]
    assert kept and new and [n for n in held if mixed[n] not in (held[n], written[n])] == []
    assert again["error"] is None
    _same_weights(again)
    assert again["logprobs"] != good["logprobs"]
    assert back["error"] is None and back["logprobs"] == good["logprobs"] == runs[1]["logprobs"]


def test_the_rl_example_runs(vllm_python, tmp_path):  # noqa: F811  (the fixture imported above)
    """examples/vllm_rl_reload.py: a trainer task writes each step's checkpoint, an engine actor reloads it, and
    the example's own check (logprobs a fresh engine's on the step's checkpoint, and changed) passes each step."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([vllm_python, str(REPO / "examples" / "vllm_rl_reload.py"), "--steps", "2", "--work",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(steps) == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(s["equals_fresh_engine"] and s["changed"] for s in steps)
