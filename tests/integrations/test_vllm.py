"""raylazy as vLLM's load format (raylazy.integrations.vllm), on CPU with vLLM's CPU build.

vLLM pins torch and transformers of its own, so it runs in a virtualenv of its own, built on first use and cached
in ~/.cache/raylazy (a few minutes). Where it cannot be built the tests fail, unless RAYLAZY_NO_PACKAGE_INDEX=1
says this environment has no package index (then they skip, saying why). One subprocess (benchmarks/harness/engines.py)
starts the engines in turn: raylazy's on dense models at tp=2 and the Llama at tp=1 (greedy tokens equal to
transformers' `generate`, and the Llama's at tp=1 to an engine on vLLM's default loader), raylazy's on mixtures of experts at tp=2
(Mixtral's experts per expert, Qwen3-MoE's fused on disk, DeepSeek-V3's with MLA and a shared expert), and at
tp=2 x pp=2 with expert parallelism (loaded only: vLLM's CPU build cannot generate there with any loader).

The oracles are vLLM's own: in every raylazy engine, every worker also loads fresh copies of the model with
vLLM's default loader and with raylazy's in each of its ways (vLLM's CPU post-processing empties the served
model's linear weights, so they are compared as loaded), and every rank's weights must be equal, bit for bit;
and the worker's own /proc/self/io around the loader's `load_weights`: with `backend="ranged"` a rank's read
calls must return at most 1.05 x its need (its parameters' elements in the checkpoint's dtype) beyond the
checkpoint's headers and index (checked twice: when planned and before reading). A rank fed its neighbour's
bytes (tests/support/vllm/peer_loader.py, a broken loader of the tests' own) must fail the weight check.

What vLLM's CPU build can run differs with the CPU (docs/testing.md, "What depends on the CPU"): an engine that
fails is that run's outcome, not the session's; where vLLM's default loader fails the same engine too (a probe,
started only then), the tests that need vLLM's serving path skip with vLLM's error and the weight checks still
run; where it does not, raylazy's engine failed and its tests fail. FAULTS shows both on faults of its own.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks.harness.vllm_engines import MAX_TOKENS, PROMPTS, VLLM_PINS, VLLM_UNINSTALL, start, venv_dir
from raylazy.storage.objects import HEAD_BYTES
from tests.support import REPO
from tests.support.checkpoints import build_checkpoint, file_bytes, header_bytes

#: Set to 1 where this environment has no package index: the vLLM tests then skip instead of failing.
NO_INDEX = "RAYLAZY_NO_PACKAGE_INDEX"
#: Dense checkpoints (tests/support/checkpoints.py): Llama with GQA; Qwen2 with qkv biases and tied embeddings; a Llama
#: with one kv head (at tp=2 both ranks take it: kv replication).
MODELS = ("vllm-llama", "vllm-qwen2", "vllm-mqa")
#: Mixtures of experts: Mixtral (w1/w2/w3 per expert), Qwen3-MoE with its experts fused on disk (gate_up_proj,
#: down_proj: transformers 5's layout), DeepSeek-V3 (MLA, a dense first layer, a shared expert; vLLM's CPU
#: MLA runs in bfloat16 only).
MOE = ("vllm-mixtral", "vllm-qwen3moe", "vllm-deepseek")
DTYPE = {"vllm-deepseek": "bfloat16"}
#: The dense checkpoint the tests also serve from object storage (SeaweedFS: tests/conftest.py's `s3`).
S3_MODEL = "vllm-llama"
#: The fresh loads every worker of a raylazy engine makes, each as {"name", "format", "extra"}.
CHECKS = [{"name": "auto", "format": "auto"}, {"name": "raylazy", "format": "raylazy"},
          {"name": "ranged", "format": "raylazy", "extra": {"backend": "ranged"}}]
#: raylazy's format with the tests' broken loader (tests/support/vllm/peer_loader.py) in its place.
PEER = {"name": "peer", "format": "raylazy", "loader": "tests.support.vllm.peer_loader:PeerBytesLoader"}
#: raylazy's format whose rank 1 cannot open the checkpoint (the same module's UnopenedLoader): a check that must fail.
UNOPENED = {"name": "unopened", "format": "raylazy", "loader": "tests.support.vllm.peer_loader:UnopenedLoader"}
#: "raylazy" finds the files in the page cache (the engine's load and the default loader's just read them): it
#: copies out of it at once; "cold" first evicts them: recorded, read through the page cache together, replayed.
NODE_CHECKS = [{"name": "exchange", "format": "raylazy", "extra": {"backend": "exchange"}},
               {"name": "rerun", "format": "raylazy", "extra": {"replay": False, "warm_copies": False}},
               {"name": "cold", "format": "raylazy", "cold": True}]

pytestmark = [pytest.mark.own_processes, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]


def _step(cmd: list, what: str) -> None:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800)
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        why = f"cannot build vLLM's virtualenv ({what}: `{' '.join(map(str, cmd))}` failed: {' | '.join(tail)})"
        if os.environ.get(NO_INDEX) == "1":
            pytest.skip(f"{why}; {NO_INDEX}=1 says there is no package index here")
        pytest.fail(f"{why}; set {NO_INDEX}=1 where this environment has no package index", pytrace=False)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The cached vLLM virtualenv's python, with this checkout's raylazy installed (its entry point)."""
    root = venv_dir()
    python = root / "bin" / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one session builds; the others wait for it
        if not (root / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            _step([sys.executable, "-m", "venv", root], "create")
            _step([python, "-m", "pip", "install", "-q", *VLLM_PINS], "install vLLM")
            _step([python, "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL], "uninstall")
            _step([python, "-m", "pip", "install", "-q", "-e", f"{REPO}[s3]"], "install raylazy's dependencies")
            (root / ".complete").touch()
        # This checkout's package metadata (the entry point); the code itself comes from PYTHONPATH.
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", REPO], check=True,
                       capture_output=True, timeout=600)
    return str(python)


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory) -> dict[str, str]:
    return {m: build_checkpoint(m, tmp_path_factory.mktemp(m), dtype=torch.bfloat16, max_shard_size="200KB",
                                in_memory=m == "vllm-qwen3moe") for m in MODELS + MOE}


@pytest.fixture(scope="session")
def vllm_s3(s3, vllm_models) -> str:
    """S3_MODEL's files in the store: its s3:// URI."""
    return s3.upload_dir(vllm_models[S3_MODEL], "vllm", S3_MODEL)


#: Faults the suite feeds its own harness, to show that an engine which fails fails only its own tests (each a
#: run of benchmarks/harness/engines.py; `model` is filled in). "crash": the engines' process dies as the run starts;
#: "rejected": a setting vLLM refuses on any CPU (a context longer than the model's), so the engine cannot start;
#: "broken": every worker's model runner raises the error vLLM's CPU attention raises for a kernel it lacks on
#: some CPUs (multi-head latent attention on some AMD EPYCs), so the engine starts, loads and cannot generate.
FAULTS = {"crash": {"crash": True}, "rejected": {"engine": {"max_model_len": 1 << 20}},
          "broken": {"fail": "Unsupported block size: 16"}}


def _runs(models: dict[str, str], s3_model: str) -> list[dict]:
    """Every engine the tests start, in turn (benchmarks/harness/engines.py): the faults first, so that every other engine
    starts after them."""
    cpus = os.cpu_count() or 1
    bind = {1: "", 2: f"0|{1 % cpus}", 4: f"0|{1 % cpus}|0|{1 % cpus}"}  # workers' CPUs: 2 cores here

    def runs(ms, fmts, tp, checks):
        return [{"model": models[m], "format": f, "tp": tp, "dtype": DTYPE.get(m, "float32"), "bind": bind[tp],
                 "checks": checks if f == "raylazy" else []} for m in ms for f in fmts]

    faults = [{"model": models["vllm-llama"], "format": "raylazy", "tp": 1, "bind": "", "fault": name,
               "checks": CHECKS[:2], **fault} for name, fault in FAULTS.items()]
    pp = {"model": models["vllm-qwen3moe"], "format": "raylazy", "tp": 2, "pp": 2, "ep": True, "generate": False,
          "bind": bind[4], "checks": CHECKS}
    s3 = {"model": s3_model, "format": "raylazy", "tp": 2, "bind": bind[2],
          "checks": [{"name": "raylazy", "format": "raylazy"}]}
    return (faults + runs(MODELS[:1], ("raylazy", "auto"), 1, CHECKS)
            + runs(MODELS, ("raylazy",), 2, CHECKS + NODE_CHECKS + [PEER, UNOPENED])
            + runs(MOE, ("raylazy",), 2, CHECKS + NODE_CHECKS) + [pp, s3])


@pytest.fixture(scope="session")
def engines(vllm_python, vllm_models, s3, vllm_s3) -> dict:
    """{(model, format, tp x pp): result} of every engine, {fault name: result} of the faults and "plugins", all
    run in one subprocess, once per session. A raylazy engine that failed to start or to generate has a `probe`: the result of
    the same engine on vLLM's default loader, the oracle of whether vLLM itself can run that model here."""
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # the checks are functions sent to the workers
               VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1",  # vLLM's CPU workers never leave in its default 5 s
               **s3.environment())
    results, plugins = start(vllm_python, _runs(vllm_models, vllm_s3), env)
    name_of = {path: m for m, path in vllm_models.items()} | {vllm_s3: "s3"}
    out = {"plugins": plugins}
    for result in results:
        spec = result["spec"]
        key = spec.get("fault") or (name_of[spec["model"]], spec["format"], spec["tp"] * spec.get("pp", 1))
        out[key] = result
    return out


def _loaded(engines: dict, key) -> dict:
    """The engine's result once it started and every check loaded: what raylazy owns. Skips where vLLM's default
    loader cannot start the same engine on this CPU either (its error is the reason); fails otherwise."""
    result = engines[key]
    if result["error"] and result["error"]["stage"] in ("start", "crash"):
        _vllm_cannot(result, key)
    failed = {name: e for name, e in result["check_errors"].items() if name != UNOPENED["name"]}
    assert not failed, (key, failed)
    return result


def _tokens(engines: dict, key) -> list[list[int]]:
    """The engine's greedy tokens. Skips where vLLM's default loader cannot generate with the same engine on this
    CPU either (what vLLM's CPU build supports differs with the CPU); fails where only raylazy's engine failed."""
    result = _loaded(engines, key)
    if result["error"]:
        _vllm_cannot(result, key)
    return result["tokens"]


def _vllm_cannot(result: dict, key) -> None:
    """Skips, with vLLM's own error, if the probe (the same engine on vLLM's default loader) failed too; an engine
    on the default loader is its own probe."""
    error = result["error"]
    probe = result if result["spec"]["format"] == "auto" else result.get("probe")
    if probe and probe["error"] and probe["error"]["stage"] != "crash":  # a dead process is no verdict of vLLM's
        pytest.skip(f"vLLM's default loader cannot run {key} on this CPU either ({probe['error']['stage']}: "
                    f"{probe['error']['message'][-500:]})")
    also = "; vLLM's default loader runs the same engine" if probe else ""
    pytest.fail(f"{key} failed ({error['stage']}): {error['message'][-3000:]}{also}", pytrace=False)


@functools.cache
def _hf_greedy(model_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def _same_weights(checks: dict, name: str, ranks: int) -> None:
    """Every rank's parameters loaded by check `name` equal, bit for bit, those vLLM's default loader loaded."""
    mine, ref = checks[name], checks["auto"]
    assert len(mine) == len(ref) == ranks
    for rank, (m, r) in enumerate(zip(mine, ref)):
        assert m["digests"].keys() == r["digests"].keys() and len(r["digests"]) > 10
        assert [n for n in r["digests"] if m["digests"][n] != r["digests"][n]] == [], (name, rank)


def _metadata_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's index and config, and twice its files' headers (checked when planned and before
    reading): what a raylazy rank reads besides tensor data."""
    return 2 * header_bytes(model_dir) + sum(os.path.getsize(os.path.join(model_dir, n)) for n in (
        "config.json", "model.safetensors.index.json") if os.path.exists(os.path.join(model_dir, n)))


def _data_bytes(model_dir: str) -> int:
    return file_bytes(model_dir) - header_bytes(model_dir)


def _check_bytes(result: dict, model_dir: str, check: str = "ranged") -> None:
    """Each rank's read calls during `load_weights` (measured: rchar) returned at least its need and at most 1.05 x
    its need beyond the metadata; its need: its parameters' elements (vLLM's model) x 2 bytes (bfloat16 on disk)."""
    meta = _metadata_bytes(model_dir) + 4096  # and /proc/self/io read by the measurement itself
    for rank, c in enumerate(result["checks"][check]):
        need = c["numel"] * 2
        assert need <= c["rchar"] <= 1.05 * need + meta, (rank, need, c["rchar"], meta)


#: The engines of dense models: every one at tp=2, the Llama alone at tp=1 (one worker, reading alone).
DENSE = [(MODELS[0], 1)] + [(m, 2) for m in MODELS]


@pytest.mark.parametrize("model, tp", DENSE)
def test_weights_match_vllms_default_loader(engines, model, tp):
    """Each worker's weights are the default loader's, bit for bit, which makes the engine the default loader's."""
    _same_weights(_loaded(engines, (model, "raylazy", tp))["checks"], "raylazy", tp)


@pytest.mark.parametrize("model, tp", DENSE)
def test_greedy_tokens_match_vllm_and_transformers(engines, vllm_models, model, tp):
    """Greedy tokens equal transformers' (and for the Llama at tp=1 those of an engine on vLLM's default loader)."""
    tokens = _tokens(engines, (model, "raylazy", tp))
    assert tokens == _hf_greedy(vllm_models[model])
    if (model, "auto", tp) in engines:
        assert tokens == _tokens(engines, (model, "auto", tp))


@pytest.mark.parametrize("model", MOE)
def test_mixtures_of_experts_load_as_vllm_loads_them(engines, model):
    """tp=2: every rank's weights as vLLM's default loader's, read together with the node or alone."""
    result = _loaded(engines, (model, "raylazy", 2))
    for name in ("raylazy", "ranged", "exchange", "rerun"):
        _same_weights(result["checks"], name, 2)


@pytest.mark.parametrize("model", MOE)
def test_mixtures_of_experts_generate(engines, vllm_models, model):
    """tp=2: the engine generates, and its greedy tokens equal transformers' (in float32; DeepSeek's bfloat16
    engine only generates: its tokens are checked by its weights)."""
    tokens = _tokens(engines, (model, "raylazy", 2))
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    if model not in DTYPE:
        assert tokens == _hf_greedy(vllm_models[model])


@pytest.mark.parametrize("model, tp", DENSE + [(m, 2) for m in MOE] + [("vllm-qwen3moe", 4)])
def test_each_rank_reads_only_its_bytes(engines, vllm_models, model, tp):
    """Measured: with backend="ranged", each rank's read calls return its need, at most 1.05 x (experts read as
    slices: their tp part without expert parallelism, its own experts whole with it; a pipeline stage only its
    layers: tp=4 is tp=2 x pp=2 with expert parallelism), and each weight loader's use of every region was
    followed: the ranged loads replayed their recordings and the engine's own load (recorded, or copied at once
    out of the page cache) read no region at once for an op raylazy cannot follow."""
    result = _loaded(engines, (model, "raylazy", tp))
    assert [c["line"]["backend"] for c in result["checks"]["ranged"]] == ["ranged"] * tp
    _check_bytes(result, vllm_models[model])
    if tp > 1:
        assert all(c["rchar"] < _data_bytes(vllm_models[model]) for c in result["checks"]["ranged"])
    own = result["lines"]
    assert [s["rank"] for s in own] == list(range(tp))
    assert [c["line"]["mode"] for c in result["checks"]["ranged"]] == ["replay"] * tp
    lines = own + [c["line"] for c in result["checks"]["ranged"]]
    assert all(s["mode"] in ("replay", "at-once") and s["opaque_regions"] == s["unplanned_regions"] == 0
               for s in lines), lines


def test_expert_and_pipeline_parallel_weights_match_vllm(engines):
    """tp=2 x pp=2 with expert parallelism (Qwen3-MoE, experts fused on disk): every rank's weights as vLLM's
    default loader's (each stage's layers, each rank's experts)."""
    result = _loaded(engines, ("vllm-qwen3moe", "raylazy", 4))
    for name in ("raylazy", "ranged"):
        _same_weights(result["checks"], name, 4)


def test_a_model_in_object_storage_loads_from_the_store(engines, vllm_models, s3, vllm_s3):
    """LLM(model="s3://...", load_format="raylazy") at tp=2: vLLM fetches the config (through the Run:ai
    streamer), raylazy reads the weights from the store (SeaweedFS behind the counting proxy), the node's two
    workers together through the exchange. Every rank's weights equal, bit for bit, those vLLM's default loader
    loads from the same files on disk, and greedy tokens are transformers'. Counted by the proxy over the
    engine's load and its check's (two loads): each fetched the files' bytes at most once (a tp=2 node's union
    is the whole checkpoint, read in stripes from each file's start), beside each worker's first GET of every
    file for its header."""
    result = _loaded(engines, ("s3", "raylazy", 2))
    _same_weights({"raylazy": result["checks"]["raylazy"],
                   "auto": _loaded(engines, (S3_MODEL, "raylazy", 2))["checks"]["auto"]}, "raylazy", 2)
    assert [(s["backend"], s["node_processes"]) for s in result["lines"]] == [("exchange", 2)] * 2
    files = glob.glob(os.path.join(vllm_models[S3_MODEL], "*.safetensors"))
    first_gets = 2 * sum(min(os.path.getsize(f), HEAD_BYTES) for f in files)  # two workers
    fetched = sum(r.body_bytes for r in s3.counts.gets(vllm_s3.removeprefix("s3:/") + "/")
                  if r.path.endswith(".safetensors"))
    data, size = _data_bytes(vllm_models[S3_MODEL]), sum(os.path.getsize(f) for f in files)
    assert 2 * data <= fetched <= 2 * (size + first_gets), (fetched, data, size, first_gets)
    assert _tokens(engines, ("s3", "raylazy", 2)) == _hf_greedy(vllm_models[S3_MODEL])


@pytest.mark.parametrize("model", MODELS + MOE)
def test_a_node_reads_together(engines, vllm_models, model):
    """tp=2, the default: both workers of the node read together through the page cache (cooperative), copying
    out of a mapping of the files: their read calls return only the metadata; recorded and replayed where the
    files were evicted first, copied at once where the files are in the page cache. With the exchange, each worker
    reads a share of the node's union once and sends the other its bytes (over gloo here, as over NCCL on GPUs):
    measured, the workers' read calls together return the checkpoint's data once, however much of it both
    need (DeepSeek's replicated latent projections: more than 1.1 x the data)."""
    result = _loaded(engines, (model, "raylazy", 2))
    meta, data = _metadata_bytes(vllm_models[model]) + 4096, _data_bytes(vllm_models[model])
    warm, cold = result["checks"]["raylazy"], result["checks"]["cold"]
    _same_weights(result["checks"], "cold", 2)
    assert [(c["line"]["backend"], c["line"]["mode"]) for c in warm] == [("cooperative", "at-once")] * 2
    assert [(c["line"]["backend"], c["line"]["mode"]) for c in cold] == [("cooperative", "replay")] * 2
    assert all(c["rchar"] <= meta for c in warm + cold)
    ex = result["checks"]["exchange"]
    assert [c["line"]["backend"] for c in ex] == ["exchange"] * 2
    assert all(c["rchar"] >= 0.3 * data for c in ex)
    assert data <= sum(c["rchar"] for c in ex) <= 1.02 * data + 2 * meta
    if model == "vllm-deepseek":
        assert sum(c["numel"] * 2 for c in ex) > 1.1 * data


@pytest.mark.parametrize("model", MODELS)
def test_the_collector_makes_no_pass_while_a_worker_loads(engines, model):
    """Python's cyclic collector is paused over a raylazy worker's whole step, in every mode (copied at once,
    replayed from each reader, rerun): counted by the interpreter's own callbacks during raylazy's step in each
    check (`raylazy.integrations.worker.load_weights`; without the pause each recorded check made a pass)."""
    ours = {name: ranks for name, ranks in _loaded(engines, (model, "raylazy", 2))["checks"].items() if name != "auto"}
    assert {c["line"]["mode"] for ranks in ours.values() for c in ranks} == {"at-once", "replay", "rerun"}
    assert {name: [c["collections"] for c in ranks] for name, ranks in ours.items()} == {n: [[], []] for n in ours}


@pytest.mark.parametrize("model", MODELS)
def test_a_rank_fed_another_ranks_bytes_fails_the_weight_check(engines, model):
    """The tests' broken loader (tests/support/vllm/peer_loader.py) feeds rank 0 each region's neighbour: its sharded
    weights differ from vLLM's own loader's (every kind of them), rank 1's do not: the weight check above can fail."""
    checks = _loaded(engines, (model, "raylazy", 2))["checks"]
    peer, ref = checks["peer"], checks["auto"]
    wrong = [n for n in ref[0]["digests"] if peer[0]["digests"][n] != ref[0]["digests"][n]]
    for kind in ("embed_tokens", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert any(kind in n for n in wrong), (kind, wrong)
    assert not any("norm" in n for n in wrong)  # replicated tensors have no neighbour
    assert peer[1]["digests"] == ref[1]["digests"]


@pytest.mark.parametrize("model", MODELS)
def test_a_worker_that_cannot_open_the_checkpoint_fails_the_load_on_every_worker(engines, vllm_models, model):
    """Rank 1 cannot open the checkpoint (tests/support/vllm/peer_loader.py's UnopenedLoader): the load fails on
    both workers at once (no worker waits in a collective for the other: otherwise the engine's run would hang until
    the suite's timeout), what vLLM raises names rank 1's cause, and the engine then generates transformers' tokens."""
    result = _loaded(engines, (model, "raylazy", 2))
    assert UNOPENED["name"] not in result["checks"]
    assert "the checkpoint cannot be opened on rank 1" in result["check_errors"][UNOPENED["name"]]["message"]
    assert _tokens(engines, (model, "raylazy", 2)) == _hf_greedy(vllm_models[model])


def test_the_second_run_fallback_loads_the_same_weights(engines):
    """replay=False: the model's load_weights runs a second time over the regions read (the way taken where a
    recording cannot be replayed), and every rank's weights are vLLM's default loader's."""
    for model in MODELS:
        checks = _loaded(engines, (model, "raylazy", 2))["checks"]
        _same_weights(checks, "rerun", 2)
        assert [c["line"]["mode"] for c in checks["rerun"]] == ["rerun"] * 2


def test_the_entry_point_registers_the_format_and_bad_options_are_named(engines):
    """vLLM's own plugin loading finds the entry point; a bad model_loader_extra_config is a ConfigurationError
    naming the option, raised when vLLM makes the loader (benchmarks/harness/engines.py's `plugins`, in the engines'
    process before it imports anything of raylazy). Registering imports the plugin's module alone: raylazy's
    readers are imported where a loader is made, not in every vLLM process, and its quantization formats where a
    quantized checkpoint is opened."""
    out = dict(engines["plugins"])
    # the plugin and its fork hook (raylazy.integrations.forks: the standard library only), no reader, no Ray
    assert out.pop("registering imported") == ["raylazy", "raylazy.integrations", "raylazy.integrations.forks",
                                               "raylazy.integrations.vllm"]
    assert out.pop("ray imported") is False  # a holder is looked for only where a Ray cluster is at hand
    assert out.pop("loader") == "RaylazyModelLoader"
    made = out.pop("a loader imported")
    assert {"raylazy.integrations.worker", "raylazy.io.serving", "raylazy.io.ranged"} <= set(made), made
    assert "raylazy.core.quantization" not in made  # imported on opening a quantized checkpoint only
    assert len(out) == 4  # every bad config raised
    for extra, named in (('{"threads": 0}', "threads=0"), ('{"bogus": 1}', "bogus=1"),
                         ('{"backend": "nvme"}', "backend='nvme'"), ('{"replay": "no"}', "replay='no'")):
        assert out[extra].startswith("ConfigurationError: ") and named in out[extra], out[extra]


RAY_WORKER = """
import json, sys
import ray

@ray.remote(num_cpus=1)
def serve(model, engine_kwargs, prompts, max_tokens):
    # A Ray worker process as Ray starts it: nothing here imports raylazy; vLLM's plugin loading must find it.
    imported = sorted(m for m in sys.modules if m.startswith("raylazy"))
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    load = AsyncEngineArgs(model=model, **engine_kwargs).create_load_config()  # as Ray Serve LLM builds it
    llm = LLM(model=model, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return {"imported_before": imported, "load_format": load.load_format, "extra": load.model_loader_extra_config,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}

model, engine_kwargs, prompts, max_tokens = json.loads(sys.argv[1])
ray.init(address="local", num_cpus=1, include_dashboard=False)  # never another's cluster; the worker's log here
try:
    print("RESULT " + json.dumps(ray.get(serve.remote(model, engine_kwargs, prompts, max_tokens))))
finally:
    ray.shutdown()
"""


def test_a_ray_worker_finds_the_format_and_takes_its_options_from_engine_kwargs(engines, vllm_python, vllm_models):
    """In a Ray worker (a process Ray starts, which imports nothing of raylazy by hand), engine_kwargs as Ray Serve
    LLM passes them to vLLM (`LLMConfig(engine_kwargs=...)` -> AsyncEngineArgs) select the format and its
    options; the engine loads with raylazy (its log line, with the option) and generates the default loader's
    tokens. (Ray Serve LLM and vLLM's Ray executor themselves cannot run on vLLM's CPU build: docs/vllm.md.)"""
    model = vllm_models["vllm-llama"]
    kwargs = {"load_format": "raylazy", "model_loader_extra_config": {"backend": "ranged", "threads": 2},
              "dtype": "float32", "skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 128,
              "max_num_seqs": len(PROMPTS), "seed": 0}
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    done = subprocess.run([vllm_python, "-c", RAY_WORKER, json.dumps([model, kwargs, PROMPTS, MAX_TOKENS])],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:]
    out = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["imported_before"] == []
    assert (out["load_format"], out["extra"]) == ("raylazy", kwargs["model_loader_extra_config"])
    lines = [line for line in done.stdout.splitlines() if "raylazy: rank" in line]  # the worker's log, via Ray
    assert len(lines) == 1 and "backend=ranged" in lines[0], lines
    assert out["tokens"] == _tokens(engines, ("vllm-llama", "auto", 1))


def test_an_engine_that_fails_fails_only_its_own_tests(engines, vllm_models, vllm_s3):
    """The faults fed to the harness (FAULTS) are each reported against their own run with vLLM's error, and every
    engine after them starts and has an outcome of its own. Where vLLM's default loader fails the same way (the
    probe), what raylazy owns is still checked (the weights every worker loaded) and the rest skips, naming vLLM's
    error; where only raylazy's engine failed, its tests fail."""
    crash, rejected, broken = (engines[name] for name in FAULTS)
    assert crash["error"]["stage"] == "crash" and "probe" not in crash
    with pytest.raises(pytest.fail.Exception, match="crash"):
        _loaded(engines, "crash")
    assert rejected["error"]["stage"] == rejected["probe"]["error"]["stage"] == "start"
    assert "max_model_len" in rejected["error"]["message"], rejected["error"]
    with pytest.raises(pytest.skip.Exception, match="max_model_len"):
        _loaded(engines, "rejected")
    for outcome in (broken, broken["probe"]):
        assert outcome["error"]["stage"] == "generate" and "Unsupported block size: 16" in outcome["error"]["message"]
    _same_weights(_loaded(engines, "broken")["checks"], "raylazy", 1)
    with pytest.raises(pytest.skip.Exception, match="Unsupported block size: 16"):
        _tokens(engines, "broken")
    with pytest.raises(pytest.fail.Exception, match="default loader runs the same engine"):
        _vllm_cannot(broken | {"probe": engines[("vllm-llama", "auto", 1)]}, "broken")
    others = [r for key, r in engines.items() if isinstance(key, tuple)]
    assert [r["spec"] for r in others] == _runs(vllm_models, vllm_s3)[len(FAULTS):]  # each has its own result
    assert all(r["error"] is None or r["error"]["stage"] in ("start", "generate") for r in others)
    assert _tokens(engines, ("vllm-llama", "raylazy", 1))  # the run right after the faults
