"""Every architecture vLLM serves, on load_format="raylazy" at tp=2, against vLLM's default loader.

Tiny random checkpoints are written by transformers in this environment (tests/core/test_declared.py's
`write_checkpoint`: vLLM's own transformers is older than some configs it writes) and served in vLLM's
virtualenv by one subprocess (tests/support/vllm/engines.py), one raylazy engine per architecture at tp=2. The
oracles are vLLM's own: in every worker, a fresh model loaded by vLLM's default loader and one by raylazy's, every
parameter equal by digest; and the engine's greedy tokens equal those the same engine generates once vLLM's
in-place reload (`reload_weights`) has put the weights vLLM's default loader reads into it (an engine start
fewer than a second engine on the default loader), or, where that reload is not the default loader's engine
(`SECOND_ENGINE`), those of a second engine on the default loader.

`ARCHS` holds every architecture whose vLLM loader reshapes or fuses weights on load (Falcon's per-kv-head q|k|v
viewed and concatenated, Bloom's per-head q|k|v viewed and transposed, GPT-2's Conv1D transposed, GPT-BigCode's
multi-query c_attn split, GPT-NeoX's per-head query_key_value, Phi-3's fused qkv and gate_up, ...) and the common
dense and mixture-of-experts ones; `LEFT_OUT` those that cannot be compared here, and why (each found by trying).
The suite runs `SUITE`; `python -m pytest tests/integrations/test_vllm_matrix.py -m matrix` runs `ARCHS`, and
`python -m benchmarks.vllm_matrix` prints the bytes each worker read beside its parameters'.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.core.test_declared import write_checkpoint
from tests.integrations.test_declared_vllm import SIZES
from tests.integrations.test_vllm import MAX_TOKENS, PROMPTS, _same_weights, _start, vllm_python  # noqa: F401

TP = 2
#: Architecture -> (transformers' model type, its config beyond SIZES: None drops a size the config computes).
ARCHS: dict[str, tuple[str, dict]] = {
    "falcon": ("falcon", {"head_dim": None, "new_decoder_architecture": False, "multi_query": True}),
    "falcon-gqa": ("falcon", {"head_dim": None, "new_decoder_architecture": True, "num_kv_heads": 2}),
    "bloom": ("bloom", {}),
    "gpt2": ("gpt2", {}),
    "gpt_bigcode": ("gpt_bigcode", {"multi_query": True}),
    "gpt_neox": ("gpt_neox", {}),
    "phi3": ("phi3", {}),
    "gptj": ("gptj", {}),
    "opt": ("opt", {"ffn_dim": 256, "word_embed_proj_dim": 128}),
    "stablelm": ("stablelm", {}),
    "phimoe": "vLLM's default loader fails the same engine: its workers fail to initialize",
    "dbrx": ("dbrx", {"d_model": 128, "n_heads": 4, "n_layers": 2, "max_seq_len": 256,
                      "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
                      "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}}),
    "starcoder2": ("starcoder2", {}),
    "phi": ("phi", {}),
    "olmo2": ("olmo2", {}),
    "gpt_oss": ("gpt_oss", {}),
    **{t: (t, {}) for t in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "granite",
                            "cohere", "glm4", "exaone4", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2",
                            "deepseek_v3", "granitemoe", "phimoe", "glm4_moe")},
}
#: What the suite runs: Falcon (a view that regroups its fused q|k|v, read at once) and GPT-2 (Conv1D, transposed).
SUITE = ("falcon", "gpt2")
#: Architectures of ARCHS not compared, and why (what trying them gave).
LEFT_OUT = {
    "gptj": "vLLM's default loader fails the same engine: its workers fail to initialize (test_declared_vllm.py "
            "finds vLLM's transformers, < 5.20, refusing the config transformers 5.24 writes)",
    "dbrx": "vLLM's default loader fails the same engine: vLLM's ModelConfig refuses the config transformers 5.24 "
            "writes (unknown kwargs `_name_or_path`, `output_attentions`)",
}
#: vLLM's CPU multi-head latent attention runs in bfloat16 only.
DTYPE = {"deepseek_v2": "bfloat16", "deepseek_v3": "bfloat16"}
CHECKS = [{"name": "auto", "format": "auto"}, {"name": "raylazy", "format": "raylazy"}]
#: Where vLLM's in-place reload of the default loader's weights does not give the default loader's engine on its CPU
#: build (fused MoE layers: the tokens after it differ while every weight loaded fresh is equal), a second engine,
#: on the default loader, gives the tokens.
SECOND_ENGINE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]


def _selected(config) -> tuple[str, ...]:
    return tuple(a for a in ARCHS if a not in LEFT_OUT) if "matrix" in (config.getoption("markexpr") or "") else SUITE


def pytest_generate_tests(metafunc):
    if "arch" in metafunc.fixturenames:
        metafunc.parametrize("arch", _selected(metafunc.config))


def serve(python: str, archs, root: Path, dtype: str | None = None, extra: dict | None = None,
          checks: bool = True) -> dict[str, dict]:
    """{arch: its engine's result (tests/support/vllm/engines.py)}: each architecture's checkpoint written under
    `root` and served at tp=2 with raylazy, one engine after the other in one process; `dtype` (default: float32,
    DTYPE's where named) and `extra` (model_loader_extra_config) are the engines'; with `checks`, every worker's
    fresh loads (CHECKS) and the greedy tokens before and after vLLM's reload of its default loader's weights."""
    dirs = {a: write_checkpoint(a, str(root), SIZES, ARCHS[a]) for a in archs}
    def run(arch, fmt):
        return {"model": dirs[arch], "format": fmt, "tp": TP, "dtype": dtype or DTYPE.get(arch, "float32"),
                "extra": extra or {}, "bind": "|".join(str(i % (os.cpu_count() or 1)) for i in range(TP)),
                "checks": CHECKS if checks and fmt == "raylazy" else [],
                "reload": checks and fmt == "raylazy" and arch not in SECOND_ENGINE}

    runs = [run(a, f) for a in dirs for f in ("raylazy", "auto") if f == "raylazy" or checks and a in SECOND_ENGINE]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1")
    results, _ = _start(python, runs, env, timeout=600 * len(runs))
    out = {}
    for spec, result in zip(runs, results):
        arch = Path(spec["model"]).name
        if spec["format"] == "raylazy":
            out[arch] = result
        else:
            out[arch]["reloaded_tokens"] = result["tokens"]  # the default loader's engine's
    return out


@pytest.fixture(scope="module")
def served(request, vllm_python, tmp_path_factory) -> dict[str, dict]:  # noqa: F811
    # the engines record and replay (the path every loader's ops must be followed on); their checks, the
    # checkpoint in the page cache, copy out of it at once
    return serve(vllm_python, _selected(request.config), tmp_path_factory.mktemp("vllm_matrix"),
                 extra={"warm_copies": False})


def _served(served: dict, arch: str, generated: bool = True) -> dict:
    """The engine's result once it started (and, `generated`, generated). Where vLLM's default loader fails the
    same engine at the same stage on this CPU (its probe: docs/testing.md, "What depends on the CPU") the test skips
    with vLLM's error; where only raylazy's engine failed it fails."""
    result = served[arch]
    error, probe = result["error"], (result.get("probe") or {}).get("error")
    if error and (generated or error["stage"] in ("start", "crash")):
        if probe and probe["stage"] == error["stage"] != "crash":
            pytest.skip(f"vLLM's default loader fails the same engine on this CPU: {probe['message'][:300]}")
        pytest.fail(f"{arch}: {error}; vLLM's default loader: {probe or 'runs the same engine'}", pytrace=False)
    assert not result["check_errors"], result["check_errors"]
    return result


@pytest.mark.matrix
def test_every_workers_weights_are_the_default_loaders(served, arch):
    """Every parameter of every worker, loaded by raylazy, equals by digest the one vLLM's default loader loads."""
    _same_weights(_served(served, arch, generated=False)["checks"], "raylazy", TP)


@pytest.mark.matrix
def test_greedy_tokens_are_the_default_loaders(served, arch):
    """The raylazy engine's greedy tokens equal the same engine's once it holds the default loader's weights."""
    result = _served(served, arch)
    assert len(result["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in result["tokens"])
    assert result["tokens"] == result["reloaded_tokens"]


@pytest.mark.matrix
def test_each_worker_reports_its_load(served, arch):
    """Each worker logs its load (raylazy/integrations/report.py): the engine's replayed, its check's copied at once
    out of the page cache, their parameters' bytes counted, and no region taken only on a second run."""
    result = _served(served, arch, generated=False)
    lines, checks = result["lines"], [c["line"] for c in result["checks"]["raylazy"]]
    assert [s["rank"] for s in lines] == [s["rank"] for s in checks] == list(range(TP))
    assert [s["mode"] for s in lines + checks] == ["replay"] * TP + ["at-once"] * TP
    assert all(s["param_bytes"] > 0 and s["unplanned_regions"] == 0 for s in lines + checks), lines + checks
