"""Write a small Llama-shaped sharded checkpoint (random weights) for demos when no model is given.

The tensor names, index file and config.json follow what transformers'
`save_pretrained` writes for a Llama model, so the llama preset shards it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int = 512
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    intermediate_size: int = 1408
    num_hidden_layers: int = 4
    vocab_size: int = 8192

    def tensors(self) -> dict[str, tuple[int, ...]]:
        h, kv = self.hidden_size, self.hidden_size // self.num_attention_heads * self.num_key_value_heads
        i = self.intermediate_size
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def write_llama_checkpoint(directory: str, shape: LlamaShape = LlamaShape(), num_files: int = 3, seed: int = 0) -> str:
    """Write `num_files` bf16 shards, the index and config.json into `directory`; returns it."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    names = list(shape.tensors().items())
    per_file = -(-len(names) // num_files)
    weight_map = {}
    for f in range(num_files):
        fname = f"model-{f + 1:05d}-of-{num_files:05d}.safetensors"
        chunk = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in names[f * per_file : (f + 1) * per_file]}
        save_file(chunk, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
                   "head_dim": shape.hidden_size // shape.num_attention_heads, **asdict(shape)}, fh, indent=2)
    return directory
