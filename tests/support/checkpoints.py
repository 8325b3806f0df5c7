"""Tiny real transformers checkpoints for the test suite, and a reference reader.

The fixtures in conftest.py call `build_checkpoint`; tests that need a checkpoint of
their own (another dtype, a single file) can call it directly. Every checkpoint is
written by transformers' `save_pretrained` with a small `max_shard_size`, so it has
several shards, a `model.safetensors.index.json` and a `config.json`, exactly as a
Hugging Face model directory has.

All weights are re-drawn from a seeded normal distribution: transformers initialises
norms to ones and biases to zeros, and constant tensors would hide slicing and
offset bugs in bit-for-bit comparisons.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from safetensors import safe_open

from raylazy.storage.probe import READ_BYTES, SERIAL, TOGETHER

#: Names of the session fixtures (in conftest.py) that hold a multi-shard checkpoint.
MODEL_FIXTURES = ("llama_dir", "qwen2_dir", "mixtral_dir")

#: transformers config class and keyword arguments of each model.
MODEL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,  # GQA: 4 query heads per kv head
            head_dim=8,
            intermediate_size=128,
            num_hidden_layers=2,
            vocab_size=256,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": (  # q/k/v projections have biases
        "Qwen2Config",
        dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=96,
            num_hidden_layers=2,
            vocab_size=256,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            vocab_size=256,
            tie_word_embeddings=False,
        ),
    ),
    # Mixtures of experts that the stage and expert-parallel tests plan (tests/core/test_stages.py).
    "qwen2_moe": (  # a dense first layer (mlp_only_layers), a shared expert with its gate
        "Qwen2MoeConfig",
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=64,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
             num_hidden_layers=3, mlp_only_layers=[0], vocab_size=256, tie_word_embeddings=False),
    ),
    "qwen3_moe": (  # tied embeddings: no lm_head.weight on disk
        "Qwen3MoeConfig",
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=64,
             moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3, vocab_size=256,
             tie_word_embeddings=True),
    ),
    "deepseek_v3": (  # multi-head latent attention, a dense first layer, one shared expert, 6 routed experts
        "DeepseekV3Config",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
             moe_intermediate_size=32, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
             topk_group=1, first_k_dense_replace=1, num_hidden_layers=3, vocab_size=256, q_lora_rank=32,
             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, tie_word_embeddings=False),
    ),
    # For vLLM on CPU (tests/integrations/test_vllm.py): head_dim >= 32 (its CPU attention needs it), a small vocabulary.
    "vllm-llama": (  # GQA: 2 query heads per kv head
        "LlamaConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
             num_hidden_layers=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False),
    ),
    "vllm-qwen2": (  # q/k/v biases, lm_head tied to the embeddings
        "Qwen2Config",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=192,
             num_hidden_layers=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=True),
    ),
    "vllm-mqa": (  # one kv head: at tp=2 both ranks take it (kv replication)
        "LlamaConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=256,
             num_hidden_layers=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False),
    ),
    # Mixtures of experts for vLLM on CPU: experts per expert on disk (Mixtral's w1/w2/w3, Qwen's and DeepSeek's
    # gate/up/down_proj), a shared expert with its gate (Qwen2-MoE), multi-head latent attention, a dense first
    # layer and a shared expert (DeepSeek-V3, its gate's score correction bias: topk_method noaux_tc; MLA on CPUs takes kv_lora_rank +
    # qk_rope_head_dim of 320, 512 or 576, and bfloat16).
    "vllm-mixtral": (
        "MixtralConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
             num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=512,
             max_position_embeddings=256, tie_word_embeddings=False),
    ),
    "vllm-qwen2moe": (
        "Qwen2MoeConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
             num_hidden_layers=2, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False),
    ),
    "vllm-qwen3moe": (  # built in_memory: the experts fused on disk, as transformers 5 holds them
        "Qwen3MoeConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=128,
             moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=512,
             max_position_embeddings=256, tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"]),
    ),
    "vllm-deepseek": (
        "DeepseekV3Config",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=192,
             moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
             topk_group=1, topk_method="noaux_tc", first_k_dense_replace=1, num_hidden_layers=2, vocab_size=512,
             q_lora_rank=64, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
             max_position_embeddings=256, tie_word_embeddings=False),
    ),
}

#: Small enough that every model above is written as 2-5 shards.
DEFAULT_SHARD_SIZE = "80KB"

_SEEDS = {"llama": 1, "qwen2": 2, "mixtral": 3, "qwen2_moe": 4, "qwen3_moe": 5, "deepseek_v3": 6, "vllm-llama": 7,
          "vllm-qwen2": 8, "vllm-mqa": 9, "vllm-mixtral": 10, "vllm-qwen2moe": 11, "vllm-deepseek": 12,
          "vllm-qwen3moe": 13}


def build_checkpoint(
    kind: str,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    seed: int | None = None,
    in_memory: bool = False,
) -> str:
    """Write the `kind` model (a key of MODEL_SPECS: "llama", "qwen2", "mixtral"...) to `out_dir` with save_pretrained
    (with `in_memory`: its state_dict, in one file, as transformers 5 holds it in memory).

    The same kind, dtype and seed always give the same tensors, whatever the shard size.
    """
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    class_name, kwargs = MODEL_SPECS[kind]
    config = getattr(transformers, class_name)(**kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator().manual_seed(_SEEDS[kind] if seed is None else seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            # Drawn in float32 then cast, so the values do not depend on the dtype's RNG path.
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).to(param.dtype))
    out_dir = os.fspath(out_dir)
    if in_memory:  # the state_dict as transformers 5 holds it (MoE experts fused), saved by safetensors
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out_dir, "model.safetensors"))
        config.save_pretrained(out_dir)
        return out_dir
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    return out_dir


def shard_files(model_dir: str | os.PathLike) -> list[str]:
    """The `*.safetensors` file names in `model_dir`, sorted."""
    return sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))


def file_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the `*.safetensors` files in `model_dir`."""
    return sum(os.path.getsize(os.path.join(model_dir, n)) for n in shard_files(model_dir))


def header_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes of the `*.safetensors` files' headers in `model_dir` (each its 8-byte length and its JSON): what a header
    read asks of the storage."""
    total = 0
    for name in shard_files(model_dir):
        with open(os.path.join(model_dir, name), "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def probe_bytes(model_dir: str | os.PathLike) -> int:
    """Bytes a probe of the mount holding `model_dir` reads (`raylazy.storage.probe`, where every read reaches the
    storage): the first file's 8-byte header length, then its first `READ_BYTES` at most (within its header) each
    of the other reads."""
    with open(os.path.join(model_dir, shard_files(model_dir)[0]), "rb") as f:
        return 8 + (SERIAL + TOGETHER - 1) * min(READ_BYTES, 8 + int.from_bytes(f.read(8), "little"))


def reference_tensors(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in `model_dir`, read by safetensors itself."""
    out: dict[str, torch.Tensor] = {}
    for name in shard_files(model_dir):
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():
                if key in out:
                    raise AssertionError(f"{key} is in two files of {model_dir}")
                out[key] = f.get_tensor(key).clone()  # not a view of safetensors' mapping: the files can be evicted
    return out


def make_hf_cache(src: str, cache: str, repo: str = "models--org--tiny", rev: str = "0123abcd", ref: str = "main") -> str:
    """Copy `src` as the hub cache stores it: snapshots/<rev>/<name> -> ../../blobs/<sha256>, refs/<ref> -> rev."""
    blobs = os.path.join(cache, repo, "blobs")
    snap = os.path.join(cache, repo, "snapshots", rev)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snap)
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, digest), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", digest), os.path.join(snap, name))
    os.makedirs(os.path.join(cache, repo, "refs"), exist_ok=True)
    with open(os.path.join(cache, repo, "refs", ref), "w") as f:
        f.write(rev)
    return snap


if __name__ == "__main__":  # print what transformers writes, for the record
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for kind in MODEL_SPECS:
            d = build_checkpoint(kind, os.path.join(tmp, kind))
            print(f"== {kind}: {shard_files(d)}")
            for key, t in sorted(reference_tensors(d).items()):
                print(f"  {key:60s} {str(t.dtype):16s} {tuple(t.shape)}")
