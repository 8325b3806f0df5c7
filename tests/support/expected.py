"""The tests' oracle of placement: what each tp rank must hold of each tensor, written here from the sharding vLLM
applies to these models (column-parallel projections as `torch.chunk` over dim 0, row-parallel ones over the last
dim, kv heads replicated when fewer than the ranks, experts in contiguous blocks under expert parallelism), never
from raylazy's plan. Full tensors come from safetensors' get_tensor (`checkpoints.reference_tensors`).

A planner that gave every rank the same slice, or slices in the wrong order, fails every test built on it
(`raytest.check_rank`, tests/core/test_planner.py, tests/core/test_stages.py).
"""

from __future__ import annotations

import json
import os
import re

import torch

EXPERT = re.compile(r"experts\.(\d+)\.")
_COLUMN = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
           "q_b_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight",
           "embed_tokens.weight", "lm_head.weight")
_ROW = ("o_proj.weight", "down_proj.weight", "w2.weight")


def model_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def expected_shard(name: str, full: torch.Tensor, rank: int, tp: int, ep: bool, cfg: dict) -> torch.Tensor | None:
    """What tp rank `rank` holds of `full` (None: nothing), by the sharding vLLM applies to these models."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    kv_heads = cfg["num_key_value_heads"]
    if name.endswith("experts.gate_up_proj"):  # fused [E, 2I, H]: gate rows, then up rows
        if ep:
            return full.tensor_split(tp, 0)[rank]
        gate, up = full.chunk(2, 1)
        return torch.cat([gate.chunk(tp, 1)[rank], up.chunk(tp, 1)[rank]], 1)
    if name.endswith("experts.down_proj"):  # fused [E, H, I]
        return full.tensor_split(tp, 0)[rank] if ep else full.chunk(tp, -1)[rank]
    m = EXPERT.search(name)
    if m and ep:
        return full if int(m.group(1)) in torch.arange(experts).tensor_split(tp)[rank] else None
    if re.search(r"[kv]_proj\.(weight|bias)$", name) and tp > kv_heads:  # each kv head on tp / kv_heads ranks
        return full.chunk(kv_heads, 0)[rank // (tp // kv_heads)]
    if name.endswith(_COLUMN):
        return full.chunk(tp, 0)[rank]
    if name.endswith(_ROW):
        return full.chunk(tp, -1)[rank]
    return full  # norms, routers and their bias, MLA's low-rank down-projections, the shared expert's gate


def expected_rank(full: dict[str, torch.Tensor], cfg: dict, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Every tensor tp rank `rank` of a tp-only load (one stage, no expert parallelism) holds: all of them, sliced."""
    return {name: expected_shard(name, t, rank, tp, False, cfg) for name, t in full.items()}
