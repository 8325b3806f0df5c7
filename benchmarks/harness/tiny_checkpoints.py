"""Tiny random checkpoints written by transformers itself (`AutoConfig.for_model(type, **small sizes)`,
`from_config`, `save_pretrained` in several shards: no downloads)."""

from __future__ import annotations

import os
import zlib

#: Sizes every architecture gets (vLLM-free: head_dim 16 is fine for transformers on CPUs).
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=2, vocab_size=256, moe_intermediate_size=32, num_local_experts=4, num_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)


def write_checkpoint(arch: str, root: str, model_type: tuple[str, dict], sizes: dict | None = None) -> str:
    """`arch` written under `root` by transformers' save_pretrained in shards, every parameter drawn at random
    (seeded by the name); `model_type`: (transformers' model type, its sizes beyond SMALL, None dropping one);
    `sizes` replace SMALL's."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    kind, extra = model_type
    config = AutoConfig.for_model(kind, **{k: v for k, v in {**SMALL, **(sizes or {}), **extra}.items() if v is not None})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(zlib.crc32(arch.encode()))
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=generator).to(p.dtype))
    out = os.path.join(root, arch)
    model.save_pretrained(out, max_shard_size="100KB")
    return out


#: The linear layers a quantized checkpoint holds in int8 (the others, embeddings, norms, lm_head, stay as written).
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", ".w1.", ".w2.", ".w3.")


def quantize_int8(path: str, strategy: str) -> None:
    """The checkpoint at `path` rewritten as compressed-tensors W8A8 int8 (what llm-compressor writes): each linear
    weight symmetric int8 with a float32 `weight_scale` per tensor (`strategy` "tensor", shape [1]) or per output
    channel ("channel", shape [out, 1]), activations quantized per token at run time; its config says so."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    for name in sorted(set(index["weight_map"].values())):
        tensors, out = load_file(os.path.join(path, name)), {}
        for key, w in tensors.items():
            if key.endswith(".weight") and any(p in key for p in LINEAR):
                w = w.float()
                scale = (w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().max().reshape(1)) / 127
                out[key] = (w / scale).round().clamp(-128, 127).to(torch.int8)
                out[key.removesuffix("weight") + "weight_scale"] = scale
            else:
                out[key] = w
        save_file(out, os.path.join(path, name), metadata={"format": "pt"})
        index["weight_map"].update({key: name for key in out})
    json.dump(index, open(index_path, "w"))
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    quant = {"num_bits": 8, "type": "int", "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**quant, "strategy": strategy, "dynamic": False},
                                      "input_activations": {**quant, "strategy": "token", "dynamic": True}}}}
    json.dump(config, open(config_path, "w"))
