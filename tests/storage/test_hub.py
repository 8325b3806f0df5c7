"""Model ids resolve through the local Hugging Face cache (no network): `org/name`, `org/name@revision`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import raylazy
from raylazy.errors import CheckpointNotFoundError, ModelNotCachedError
from raylazy.storage.hub import hub_cache_dir, resolve_model
from tests.support.checkpoints import make_hf_cache

MAIN = "0" * 39 + "1"  # commit hashes, as the hub writes them (40 hex digits)
OLD = "f" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch, llama_dir, qwen2_dir) -> dict:
    """A cache holding org/tiny: main -> a llama snapshot, tag v1 -> an older qwen2 snapshot."""
    cache = str(tmp_path / "hub")
    snaps = {"main": make_hf_cache(llama_dir, cache, rev=MAIN), "v1": make_hf_cache(qwen2_dir, cache, rev=OLD, ref="v1")}
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.chdir(tmp_path)  # no directory named org/ here
    return {"cache": cache, **snaps}


def _same_layout(a: raylazy.Plan, b: raylazy.Plan) -> bool:
    """Same model type and, rank by rank, the same tensors read at the same offsets (paths differ)."""
    return a.model_type == b.model_type and [r.tensors for r in a.ranks] == [r.tensors for r in b.ranks]


def test_model_id_resolves_to_the_main_snapshot(hub, llama_dir):
    assert resolve_model("org/tiny") == hub["main"]
    plan = raylazy.plan("org/tiny", 2)
    assert plan.root == hub["main"]
    assert _same_layout(plan, raylazy.plan(llama_dir, 2))


@pytest.mark.parametrize("revision", ["v1", OLD])
def test_revision_by_tag_or_commit(hub, qwen2_dir, revision):
    plan = raylazy.plan(f"org/tiny@{revision}", 2)
    assert plan.root == hub["v1"] and plan.model_type == "qwen2"
    assert _same_layout(plan, raylazy.plan(qwen2_dir, 2))


def test_cache_location_from_hf_home(tmp_path, monkeypatch, llama_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    snap = make_hf_cache(llama_dir, hub_cache_dir(), rev=MAIN)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == snap


def test_a_local_directory_wins_over_the_cache(hub, tmp_path, mixtral_dir):
    os.makedirs(tmp_path / "org")
    os.symlink(mixtral_dir, tmp_path / "org" / "tiny")
    assert raylazy.plan("org/tiny", 2).model_type == "mixtral"


@pytest.mark.parametrize("model, looked", [("org/absent", "models--org--absent"), ("org/tiny@v9", "models--org--tiny"),
                                           ("tiny", "models--tiny")])
def test_not_cached_says_where_it_looked(hub, model, looked):
    with pytest.raises(ModelNotCachedError) as info:
        raylazy.plan(model, 2)
    msg = str(info.value)
    assert os.path.join(hub["cache"], looked) in msg and "never downloads" in msg
    assert isinstance(info.value, CheckpointNotFoundError)


@pytest.mark.parametrize("model", ["./missing", "/nonexistent/dir", "a/b/c", "bad name"])
def test_paths_that_are_not_model_ids_are_not_found(hub, model):
    with pytest.raises(CheckpointNotFoundError) as info:
        raylazy.plan(model, 2)
    assert not isinstance(info.value, ModelNotCachedError) and "no such file or directory" in str(info.value)


def test_cli_plans_a_cached_model_and_reports_a_missing_one(hub):
    env = {**os.environ, "HF_HUB_CACHE": hub["cache"]}
    run = subprocess.run([sys.executable, "-m", "raylazy.cli", "plan", "org/tiny@v1", "--tp", "2"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert hub["v1"] in run.stdout and "(qwen2)" in run.stdout
    run = subprocess.run([sys.executable, "-m", "raylazy.cli", "plan", "org/absent", "--tp", "2"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "ModelNotCachedError" in run.stderr and "models--org--absent" in run.stderr
