"""Quantized checkpoints, by a property no loader computes: each rank's shards, dequantized, equal that rank's
slice of the dequantized full tensors.

Every test writes its own checkpoint from random codes and scales (safetensors and a config.json with the
format's `quantization_config`; no quantization library, no GPU) and dequantizes it as the format defines it
(tests/support/quantized.py). The rank slices are the tensor-parallel convention, written out here (`expected`):
column-parallel layers split their output rows, row-parallel ones their input columns, attention by whole heads
(kv heads replicated past their count), fused q|k|v and gate|up per part, and with expert parallel each expert
whole on its rank (vLLM's linear expert map). Plans run through raylazy.plan and raylazy.io.ranged.read_rank_ranged.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import raylazy
from raylazy.core.header import TensorInfo
from raylazy.core.quantization import parse_quantization
from raylazy.errors import (
    QuantizedLayoutError,
    QuantizedSplitError,
    ShardingError,
    UnsupportedQuantizationError,
)
from raylazy.io.ranged import read_rank_ranged
from tests.support import quantized as q
from tests.support.checkpoints import reference_tensors
from tests.support.planlib import as_bytes, reference_shard

HEADS, KV_HEADS, HEAD_DIM, H, I, IE, E, V = 4, 2, 128, 256, 512, 512, 4, 256


def _layers() -> dict[str, tuple[int, int, str]]:
    """The quantized layers of the test model (qwen2_moe names): prefix -> (N, K, how tp splits it)."""
    p0, p1 = "model.layers.0.", "model.layers.1."
    out = {p0 + "self_attn.qkv_proj": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, H, "qkv"),
           p0 + "self_attn.o_proj": (H, HEADS * HEAD_DIM, "row"),
           p0 + "mlp.gate_up_proj": (2 * I, H, "gate_up"),
           p0 + "mlp.down_proj": (H, I, "row"),
           p1 + "self_attn.q_proj": (HEADS * HEAD_DIM, H, "q"),
           p1 + "self_attn.k_proj": (KV_HEADS * HEAD_DIM, H, "kv"),
           p1 + "self_attn.v_proj": (KV_HEADS * HEAD_DIM, H, "kv"),
           p1 + "self_attn.o_proj": (H, HEADS * HEAD_DIM, "row")}
    for mlp in [f"mlp.experts.{e}." for e in range(E)] + ["mlp.shared_expert."]:
        out |= {p1 + mlp + "gate_proj": (IE, H, "column"), p1 + mlp + "up_proj": (IE, H, "column"),
                p1 + mlp + "down_proj": (H, IE, "row")}
    return out


LAYERS = _layers()
PLAIN = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H),
         "model.layers.1.mlp.gate.weight": (E, H), "model.layers.1.mlp.shared_expert_gate.weight": (1, H),
         **{f"model.layers.{i}.{n}.weight": (H,) for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")}}


def _ct(weights: dict, fmt: str, inputs: dict | None = None) -> dict:
    """A compressed-tensors quantization_config of one group over every Linear but lm_head."""
    group = {"targets": ["Linear"], "weights": {"symmetric": True, "dynamic": False, **weights},
             "input_activations": inputs}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
#: name -> (quantization_config, encode(n, k, generator) -> {suffix: tensor}, decode({suffix: tensor}) -> [N, K]).
FORMATS = {
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
                  q.fp8_block_encode, q.fp8_block_decode),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, q.fp8_tensor_encode, q.fp8_scaled_decode),
    "ct-fp8-channel": (_ct({"num_bits": 8, "type": "float", "strategy": "channel"}, "float-quantized",
                           {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}),
                       q.fp8_channel_encode, q.fp8_scaled_decode),
    "ct-nvfp4": (_ct({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                     "nvfp4-pack-quantized"), q.nvfp4_encode, q.nvfp4_decode),
    "ct-int4": (_ct(INT4, "pack-quantized"), q.ct_int4_encode, q.ct_int4_decode),
    "ct-int4-asym": (_ct({**INT4, "symmetric": False}, "pack-quantized"),
                     lambda n, k, g: q.ct_int4_encode(n, k, g, zero_point=True), q.ct_int4_decode),
    "ct-int4-actorder": (_ct({**INT4, "actorder": "group"}, "pack-quantized"),
                         lambda n, k, g: q.ct_int4_encode(n, k, g, act_order=True), q.ct_int4_decode),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq"}, q.gptq_encode, q.gptq_decode),
    "gptq-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
                       lambda n, k, g: q.gptq_encode(n, k, g, act_order=True),
                       lambda t: q.gptq_decode(t, act_order=True)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            q.awq_encode, q.awq_decode),
}


def write_checkpoint(out_dir, tensors: dict[str, torch.Tensor], config: dict) -> str:
    """`tensors` as one safetensors file and `config` as config.json in `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return os.fspath(out_dir)


def _model(out_dir, fmt: str) -> str:
    config, encode, _ = FORMATS[fmt]
    g = torch.Generator().manual_seed(sorted(FORMATS).index(fmt))
    tensors = {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in PLAIN.items()}
    for prefix, (n, k, _) in LAYERS.items():
        tensors |= {f"{prefix}.{suffix}": t for suffix, t in encode(n, k, g).items()}
    return write_checkpoint(out_dir, tensors, {
        "model_type": "qwen2_moe", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_experts": E, "num_hidden_layers": 2, "vocab_size": V,
        "tie_word_embeddings": False, "quantization_config": config})


@pytest.fixture(scope="module", params=sorted(FORMATS))
def quantized_model(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, _model(tmp_path_factory.mktemp(request.param), request.param)


# --- the tensor-parallel convention, written out --------------------------------------------------------------


def _rows(w: torch.Tensor, r: int, tp: int, dim: int = 0) -> torch.Tensor:
    n = w.shape[dim] // tp
    return w.narrow(dim, r * n, n)


def _heads(w: torch.Tensor, r: int, tp: int, heads: int) -> torch.Tensor:
    size = w.shape[0] // heads
    if tp > heads:  # each kv head replicated over tp / heads consecutive ranks
        return w[r // (tp // heads) * size:][:size]
    return _rows(w, r, tp)


def expected(w: torch.Tensor, kind: str, r: int, tp: int) -> torch.Tensor:
    """Rank r's part of the dequantized weight `w` [N, K] of a layer split as `kind`."""
    if kind == "row":
        return _rows(w, r, tp, 1)
    if kind in ("column", "q"):
        return _rows(w, r, tp) if kind == "column" else _heads(w, r, tp, HEADS)
    if kind == "kv":
        return _heads(w, r, tp, KV_HEADS)
    if kind == "gate_up":
        return torch.cat([_rows(part, r, tp) for part in w.chunk(2)])
    qs, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM  # qkv
    qpart, kpart, vpart = w.split([qs, kv, kv])
    return torch.cat([_heads(qpart, r, tp, HEADS), _heads(kpart, r, tp, KV_HEADS), _heads(vpart, r, tp, KV_HEADS)])


def _expert(prefix: str) -> int | None:
    return int(prefix.split("experts.")[1].split(".")[0]) if ".experts." in prefix else None


def layer_parts(tensors: dict, prefix: str) -> dict:
    """A layer's tensors by suffix (`weight_scale_inv`, `qweight`...)."""
    return {name[len(prefix) + 1:]: t for name, t in tensors.items() if name.rpartition(".")[0] == prefix}


def rank_shards(model_dir: str, tp: int, **options) -> tuple[raylazy.Plan, list[dict]]:
    plan = raylazy.plan(model_dir, tp, **options)
    return plan, [read_rank_ranged(rp)[0] for rp in plan.ranks]


# --- the property ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp, ep", [(2, False), (4, False), (4, True)], ids=["tp2", "tp4", "tp4-ep"])
def test_rank_shards_dequantize_to_rank_slices(quantized_model, tp, ep):
    fmt, model_dir = quantized_model
    _, _, decode = FORMATS[fmt]
    full = reference_tensors(model_dir)
    dequantized = {prefix: decode(layer_parts(full, prefix)) for prefix in LAYERS}
    _, ranks = rank_shards(model_dir, tp, expert_parallel=ep)
    for r, shards in enumerate(ranks):
        for name, t in shards.items():  # on-disk dtype and encoding, whatever the format
            assert t.dtype == full[name].dtype, (name, t.dtype)
        placed = set()
        for prefix, (_, _, kind) in LAYERS.items():
            got, e = layer_parts(shards, prefix), _expert(prefix)
            if ep and e is not None:
                if e * tp // E != r:  # another rank's expert
                    assert not got, f"rank {r} holds parts of expert {e}"
                    continue
                kind = "whole"
            want = dequantized[prefix] if kind == "whole" else expected(dequantized[prefix], kind, r, tp)
            assert torch.equal(decode(got), want), f"{fmt} tp={tp} rank {r}: {prefix} dequantized differs"
            placed |= {f"{prefix}.{s}" for s in got}
        assert set(shards) - placed == set(PLAIN), f"rank {r}: {sorted(set(shards) - placed - set(PLAIN))}"


def test_plain_tensors_and_labels_are_unchanged(quantized_model):
    """Unquantized tensors plan as in a dense checkpoint; plans name a companion's role beside its weight's rule."""
    fmt, model_dir = quantized_model
    full = reference_tensors(model_dir)
    plan, ranks = rank_shards(model_dir, 2)
    for rp, shards in zip(plan.ranks, ranks):
        for t in rp.tensors:
            if t.name in PLAIN:
                assert as_bytes(shards[t.name]) == as_bytes(reference_shard(full[t.name], t)), t.name
    labels = {t.name: t.placement for t in plan.ranks[0].tensors}
    scale = next(n for n in labels if n.startswith("model.layers.1.self_attn.o_proj.") and not n.endswith(".weight"))
    assert labels[scale].startswith("split(dim=-1), "), labels[scale]


# --- formats of their own: gpt-oss's MXFP4 experts, DeepSeek-V3's released layout ------------------------------

@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    g, hidden, inter = torch.Generator().manual_seed(7), 256, 256
    p = "model.layers.0."
    tensors = {p + "self_attn.sinks": torch.randn(HEADS, generator=g), p + "mlp.router.weight": torch.randn(E, hidden),
               p + "mlp.experts.gate_up_proj_bias": torch.randn(E, 2 * inter, generator=g).to(torch.bfloat16),
               p + "mlp.experts.down_proj_bias": torch.randn(E, hidden, generator=g).to(torch.bfloat16)}
    for proj, n, k in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        tensors |= {f"{p}mlp.experts.{proj}_{s}": t for s, t in q.mxfp4_encode(E, n, k, g).items()}
    return write_checkpoint(tmp_path_factory.mktemp("gpt-oss"), tensors, {
        "model_type": "gpt_oss", "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_local_experts": E, "num_hidden_layers": 1,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}})


@pytest.mark.parametrize("tp, ep", [(2, False), (4, False), (4, True)], ids=["tp2", "tp4", "tp4-ep"])
def test_mxfp4_experts_dequantize_to_rank_slices(gpt_oss_dir, tp, ep):
    """gpt-oss's MXFP4 experts out of the box: the blocks and scales follow the built-in rules of the dense layout
    (transformers' gate_up_proj [E, H, 2I], gate and up rows interleaved and split contiguously as vLLM splits
    them; down_proj [E, I, H] split along I), the sinks by head."""
    full = reference_tensors(gpt_oss_dir)
    _, ranks = rank_shards(gpt_oss_dir, tp, expert_parallel=ep)
    p = "model.layers.0.mlp.experts."
    for r, shards in enumerate(ranks):
        for proj, dim in (("gate_up_proj", 2), ("down_proj", 1)):  # N of gate_up, K of down
            parts = {s: shards[f"{p}{proj}_{s}"] for s in ("blocks", "scales")}
            assert {t.dtype for t in parts.values()} == {torch.uint8}
            want = q.mxfp4_decode({s: full[f"{p}{proj}_{s}"] for s in ("blocks", "scales")})
            want = _rows(want, r, tp) if ep else _rows(want, r, tp, dim)
            assert torch.equal(q.mxfp4_decode(parts), want), f"rank {r}: {proj}"
        bias = full[p + "gate_up_proj_bias"]
        assert torch.equal(shards[p + "gate_up_proj_bias"], _rows(bias, r, tp) if ep else _rows(bias, r, tp, 1))
        assert torch.equal(shards["model.layers.0.self_attn.sinks"], _rows(full["model.layers.0.self_attn.sinks"], r, tp))


def _deepseek(out_dir, layers: int = 2, experts: int = 4) -> str:
    """A DeepSeek-V3-shaped FP8 checkpoint as released: 32x32 block scales (`weight_scale_inv`) beside every
    linear but the router, a dense first layer, then routed and shared experts, and one multi-token-prediction
    layer after the last (its eh_proj, norms, embeddings and head in bf16)."""
    g, h, heads, nope, rope, v, ql, kvl = torch.Generator().manual_seed(11), 128, 4, 32, 32, 32, 64, 64
    linears, plain = {}, {"model.embed_tokens.weight": (V, h), "model.norm.weight": (h,), "lm_head.weight": (V, h)}
    for i in range(layers + 1):
        p = f"model.layers.{i}."
        linears |= {p + "self_attn.q_a_proj": (ql, h), p + "self_attn.q_b_proj": (heads * (nope + rope), ql),
                    p + "self_attn.kv_a_proj_with_mqa": (kvl + rope, h), p + "self_attn.o_proj": (h, heads * v),
                    p + "self_attn.kv_b_proj": (heads * (nope + v), kvl)}
        plain |= {p + n: (d,) for n, d in (("input_layernorm.weight", h), ("post_attention_layernorm.weight", h),
                                           ("self_attn.q_a_layernorm.weight", ql), ("self_attn.kv_a_layernorm.weight", kvl))}
        mlps = {"mlp.": 256} if i == 0 else {**{f"mlp.experts.{e}.": 64 for e in range(experts)}, "mlp.shared_experts.": 128}
        for mlp, inter in mlps.items():
            linears |= {p + mlp + "gate_proj": (inter, h), p + mlp + "up_proj": (inter, h), p + mlp + "down_proj": (h, inter)}
        if i:
            plain |= {p + "mlp.gate.weight": (experts, h), p + "mlp.gate.e_score_correction_bias": (experts,)}
    mtp = f"model.layers.{layers}."
    plain |= {mtp + "eh_proj.weight": (h, 2 * h), mtp + "enorm.weight": (h,), mtp + "hnorm.weight": (h,),
              mtp + "embed_tokens.weight": (V, h), mtp + "shared_head.norm.weight": (h,), mtp + "shared_head.head.weight": (V, h)}
    tensors = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in plain.items()}
    for prefix, (n, k) in linears.items():
        tensors |= {f"{prefix}.{s}": t for s, t in q.fp8_block_encode(n, k, g, (32, 32)).items()}
    return write_checkpoint(out_dir, tensors, {
        "model_type": "deepseek_v3", "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_routed_experts": experts, "num_hidden_layers": layers, "num_nextn_predict_layers": 1, "vocab_size": V,
        "q_lora_rank": ql, "kv_lora_rank": kvl, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                "weight_block_size": [32, 32]}})


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    return _deepseek(tmp_path_factory.mktemp("deepseek-fp8"))


def _deepseek_kind(prefix: str, ep: bool) -> str:
    leaf = prefix.rpartition(".")[2]
    if leaf in ("q_a_proj", "kv_a_proj_with_mqa"):
        return "whole"
    if ep and ".experts." in prefix:
        return "expert"
    return {"q_b_proj": "heads", "kv_b_proj": "heads", "o_proj": "row", "down_proj": "row"}.get(leaf, "column")


@pytest.mark.parametrize("tp, ep", [(2, False), (2, True), (4, True)], ids=["tp2", "tp2-ep", "tp4-ep"])
def test_deepseek_v3_fp8_out_of_the_box(deepseek_dir, tp, ep):
    """The released layout plans with the preset alone: block scales follow their weights (MLA heads, experts
    with and without expert parallel), the multi-token-prediction layer (layer 2 here) is skipped."""
    full = reference_tensors(deepseek_dir)
    plan, ranks = rank_shards(deepseek_dir, tp, expert_parallel=ep)
    assert set(plan.skipped) == {n for n in full if n.startswith("model.layers.2.")}
    assert f"skipped: {plan.skipped[0]}, " in plan.summary() and f"and {len(plan.skipped) - 10:,} more" in plan.summary()
    prefixes = {n.rpartition(".")[0] for n in full if n.endswith(".weight_scale_inv") and not n.startswith("model.layers.2.")}
    for r, shards in enumerate(ranks):
        for prefix in sorted(prefixes):
            kind, got = _deepseek_kind(prefix, ep), layer_parts(shards, prefix)
            if kind == "expert" and _expert(prefix) * tp // 4 != r:
                assert not got, (r, prefix)
                continue
            want = q.fp8_block_decode(layer_parts(full, prefix), (32, 32))
            want = {"whole": want, "expert": want, "heads": _rows(want, r, tp), "row": _rows(want, r, tp, 1)}.get(
                kind, _rows(want, r, tp))
            assert torch.equal(q.fp8_block_decode(got, (32, 32)), want), (r, prefix)


def test_deepseek_v3_keep_mtp_puts_it_on_the_last_stage(deepseek_dir):
    plan = raylazy.plan(deepseek_dir, 2, pp=2, expert_parallel=True, keep_mtp=True)
    assert plan.skipped == ()
    by_rank = [{t.name: t for t in rp.tensors} for rp in plan.ranks]
    mtp = "model.layers.2."
    for r, held in enumerate(by_rank):
        assert any(n.startswith(mtp) for n in held) == (r >= 2), r  # stage 1 = ranks 2, 3
    last = by_rank[2]
    assert last[mtp + "eh_proj.weight"].dim is None  # a plain nn.Linear in vLLM's DeepSeekMTP: whole
    assert last[mtp + "shared_head.head.weight"].pieces == ((0, 0, V // 2),)  # vocab-parallel
    assert last[mtp + "self_attn.o_proj.weight_scale_inv"].pieces == ((0, 0, 2),)  # follows o_proj: 64 of 128 cols
    assert mtp + "mlp.experts.2.down_proj.weight_scale_inv" not in last  # experts 2 and 3 are tp rank 1's
    assert by_rank[3][mtp + "mlp.experts.3.down_proj.weight_scale_inv"].dim is None


# --- what cannot be sharded is an error, never a wrong shard ------------------------------------------------------


def test_split_inside_a_scale_block_is_an_error(deepseek_dir):
    with pytest.raises(QuantizedSplitError) as err:  # experts' 64 rows over tp=4: 16 each, blocks of 32
        raylazy.plan(deepseek_dir, 4)
    msg = str(err.value)
    assert re.search(r"experts\.\d\.\w+_proj\.weight_scale_inv'", msg) and "tp=4" in msg, msg
    assert "scale block of 32" in msg, msg
    assert isinstance(err.value, ShardingError)


def _llama(out_dir, fmt: dict, layers: dict[str, tuple[int, int]], encode) -> str:
    g = torch.Generator().manual_seed(3)
    tensors = {f"{p}.{s}": t for p, (n, k) in layers.items() for s, t in encode(n, k, g).items()}
    return write_checkpoint(out_dir, tensors, {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 2,
                                               "num_hidden_layers": 1, "quantization_config": fmt})


def test_split_inside_a_group_is_an_error_outside_act_order(tmp_path):
    down = {"model.layers.0.mlp.down_proj": (256, 384)}  # row-parallel: 192 input columns each at tp=2, groups of 128
    plain = _llama(tmp_path / "gptq", FORMATS["gptq"][0], down, q.gptq_encode)
    with pytest.raises(QuantizedSplitError, match=r"down_proj\.(qzeros|scales)'.*tp=2.*quantization group of 128"):
        raylazy.plan(plain, 2)
    act = _llama(tmp_path / "act", FORMATS["gptq-act-order"][0], down, lambda n, k, g: q.gptq_encode(n, k, g, act_order=True))
    full = reference_tensors(act)
    _, ranks = rank_shards(act, 2)
    prefix = "model.layers.0.mlp.down_proj"
    want = q.gptq_decode(layer_parts(full, prefix), act_order=True)
    for r, shards in enumerate(ranks):  # with act-order the scales and zeros are whole on every rank
        assert torch.equal(shards[prefix + ".scales"], full[prefix + ".scales"])
        assert torch.equal(q.gptq_decode(layer_parts(shards, prefix), act_order=True), _rows(want, r, 2, 1))


def test_split_inside_a_packed_word_is_an_error(tmp_path):
    up = {"model.layers.0.mlp.up_proj": (48, 256)}  # column-parallel at tp=4: 12 outputs each, 8 per AWQ word
    model = _llama(tmp_path, {**FORMATS["awq"][0], "group_size": 64}, up, lambda n, k, g: q.awq_encode(n, k, g, group=64))
    with pytest.raises(QuantizedSplitError, match=r"up_proj\.(qweight|qzeros)'.*tp=4.*int32 word of 8 4-bit codes"):
        raylazy.plan(model, 4)
    assert raylazy.plan(model, 2).ranks[1].tensors  # 24 outputs each: whole words


def test_a_partial_last_block_at_the_weight_end_is_not_a_cut(tmp_path):
    """A weight dim that is no multiple of its scale block (127 rows, blocks of 32: the last block holds 31) split
    unevenly (uneven="pad": 64 rows each, the last rank's 63 and a zero row): the last rank's piece ends inside that
    block, at the weight's end, so the block's scale is whole there and nothing is cut."""
    prefix, n, k = "model.layers.0.mlp.up_proj", 127, 256
    model = _llama(tmp_path, {"quant_method": "fp8", "weight_block_size": [32, 32]}, {prefix: (n, k)},
                   lambda n, k, g: q.fp8_block_encode(n, k, g, (32, 32)))
    want = q.fp8_block_decode(layer_parts(reference_tensors(model), prefix), (32, 32))
    _, ranks = rank_shards(model, 2, uneven="pad")
    for r, shards in enumerate(ranks):
        got = q.fp8_block_decode(layer_parts(shards, prefix), (32, 32))
        rows = want[64 * r: 64 * (r + 1)]
        assert got.shape == (64, k) and torch.equal(got[: len(rows)], rows), r
        assert not got[len(rows):].any()  # the padding row


def test_int8_scales_per_group_follow_their_weight(tmp_path):
    """compressed-tensors int-quantized weights with a scale per group of 64 input columns (`weight_scale`
    [N, K/64]): each rank's weight and scales dequantize to its slice, column- and row-parallel."""
    layers = {"model.layers.0.mlp.up_proj": (512, 256, "column"), "model.layers.0.mlp.down_proj": (256, 512, "row")}

    def encode(n: int, k: int, g: torch.Generator) -> dict:
        return {"weight": torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                "weight_scale": q.scales((n, k // 64), g)}

    def decode(t: dict) -> torch.Tensor:
        return t["weight"].float() * t["weight_scale"].repeat_interleave(64, 1)

    fmt = _ct({"num_bits": 8, "type": "int", "strategy": "group", "group_size": 64}, "int-quantized")
    model = _llama(tmp_path, fmt, {p: (n, k) for p, (n, k, _) in layers.items()}, encode)
    full = reference_tensors(model)
    _, ranks = rank_shards(model, 2)
    for r, shards in enumerate(ranks):
        for prefix, (_, _, kind) in layers.items():
            want = expected(decode(layer_parts(full, prefix)), kind, r, 2)
            assert torch.equal(decode(layer_parts(shards, prefix)), want), (r, prefix)


def test_fused_experts_scales_follow_the_fused_weight():
    """transformers 5's fused FP8 experts (`experts.gate_up_proj` [E, 2I, H]) keep their scales beside them as
    `experts.gate_up_proj_scale_inv` (per block of each expert) and `experts.gate_up_proj_activation_scale` (one per
    expert): both are companions of the fused weight, following its expert dim (and its blocks)."""
    p = "model.layers.0.mlp.experts."
    shapes = {p + "gate_up_proj": ("F8_E4M3", (4, 512, 256)), p + "gate_up_proj_scale_inv": ("F32", (4, 4, 2)),
              p + "gate_up_proj_activation_scale": ("F32", (4,)), p + "down_proj": ("F8_E4M3", (4, 256, 256)),
              p + "down_proj_activation_scale": ("F32", (4, 1))}
    infos = {n: TensorInfo(n, dtype, shape, 0, 0) for n, (dtype, shape) in shapes.items()}
    companions = parse_quantization({"quant_method": "fp8", "weight_block_size": [128, 128]}).companions(infos)
    follows = {n: (c.weight, [(a.dim, a.unit) if a else None for a in c.layout.axes]) for n, c in companions.items()}
    assert follows == {p + "gate_up_proj_scale_inv": (p + "gate_up_proj", [(0, 1), (1, 128), (2, 128)]),
                       p + "gate_up_proj_activation_scale": (p + "gate_up_proj", [(0, 1)]),
                       p + "down_proj_activation_scale": (p + "down_proj", [(0, 1), None])}


def test_unknown_method_and_bad_layouts_are_named(tmp_path):
    layer = {"model.layers.0.mlp.up_proj": (256, 256)}
    bnb = _llama(tmp_path / "bnb", {"quant_method": "bitsandbytes", "load_in_4bit": True}, layer, q.fp8_block_encode)
    with pytest.raises(UnsupportedQuantizationError, match="bitsandbytes"):
        raylazy.plan(bnb, 2)
    wrong = _llama(tmp_path / "block", {"quant_method": "fp8", "weight_block_size": [64, 64]}, layer, q.fp8_block_encode)
    with pytest.raises(QuantizedLayoutError, match=r"weight_scale_inv' \[2, 2\].*64x64 block scale \[4, 4\]"):
        raylazy.plan(wrong, 2)  # 128x128 scales under a config that says 64x64


# --- one load on Ray ------------------------------------------------------------------------------------------------


def test_load_on_ray_gives_the_same_dequantized_slices(deepseek_dir, ray_local):
    """FP8 shards on CPU ranks travel through Ray's object store (torch pickles float8 tensors but cannot unpickle
    them: raylazy carries them as bytes), from each rank to the caller and from replica 0 to replica 1."""
    full = reference_tensors(deepseek_dir)
    prefix = "model.layers.1.self_attn.kv_b_proj"
    want = q.fp8_block_decode(layer_parts(full, prefix), (32, 32))
    with raylazy.load(deepseek_dir, 2, expert_parallel=True, device="cpu", replicas=2) as loaded:
        assert [s.bytes_from_replica > 0 for s in loaded.stats] == [False, False, True, True]
        for rank, c in enumerate(loaded.mesh):
            shards = loaded.get(rank)
            parts = {n[len(prefix) + 1:]: t for n, t in shards.items() if n.rpartition(".")[0] == prefix}
            assert parts["weight"].dtype == torch.float8_e4m3fn
            assert torch.equal(q.fp8_block_decode(parts, (32, 32)), _rows(want, c.tp_rank, 2)), rank
