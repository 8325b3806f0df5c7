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
