"""The planner: per-rank byte ranges that reproduce exactly each rank's slice of each tensor.

Plans are executed in pure Python (tests/support/planlib.py) against the raw file bytes and
compared bit for bit with slices of the tensors safetensors itself reads.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import struct

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from raylazy.core.boxes import Region, batch_cuts, gathering
from raylazy.core.checkpoint import Checkpoint, ModelConfig
from raylazy.core.dtypes import DTYPE_BITS
from raylazy.core.header import TensorInfo, parse_header
from raylazy.core.placements import Fused, Heads, Replicated, Skip, Split
from raylazy.core.plans import Plan
from raylazy.core.rules import PRESETS, Rule
from raylazy.errors import (
    CheckpointError,
    HeaderError,
    IndivisibleDimError,
    PartialByteError,
    PartialByteSliceError,
    PlanFormatError,
    RuleError,
    ShardingError,
    UnknownArchitectureError,
    UnmatchedTensorError,
)
from raylazy.planning import make_plan
from tests.support.checkpoints import reference_tensors
from tests.support.expected import expected_rank, model_config
from tests.support.planlib import apply_reads, as_bytes, read_ranges, reference_shard

BF16 = 2  # bytes per element of the fixtures' dtype


# --- helpers -----------------------------------------------------------------


@functools.cache
def _reference(model_dir: str) -> dict[str, torch.Tensor]:
    return reference_tensors(model_dir)


@functools.cache
def _file_bytes(model_dir: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with open(os.path.join(model_dir, name), "rb") as f:
                out[name] = f.read()
    return out


def _files(plan: Plan) -> list[bytes]:
    """Raw bytes of the plan's files, indexed like Read.file (cached per directory)."""
    by_name = _file_bytes(plan.root)
    return [by_name[os.path.basename(f.uri)] for f in plan.files]


@functools.cache
def _layout(model_dir: str) -> dict[str, tuple[str, int]]:
    """tensor name -> (file name, absolute offset of its data), parsed here independently of raylazy."""
    out = {}
    for name, data in _file_bytes(model_dir).items():
        (n,) = struct.unpack("<Q", data[:8])
        for key, entry in json.loads(data[8 : 8 + n]).items():
            if key != "__metadata__":
                out[key] = (name, 8 + n + entry["data_offsets"][0])
    return out


def _shard(plan: Plan, rank: int, name: str):
    found = [t for t in plan.ranks[rank].tensors if t.name == name]
    assert len(found) == 1, f"{name} appears {len(found)} times in rank {rank}'s plan"
    return found[0]


def _check_shard_bytes(plan: Plan, shard, expected: torch.Tensor) -> None:
    assert tuple(shard.shape) == tuple(expected.shape), shard.name
    assert apply_reads(shard, _files(plan)) == as_bytes(expected), f"{shard.name}: reads give the wrong bytes"


def _write_checkpoint(path, tensors: dict[str, torch.Tensor], config: dict | None) -> str:
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    if config is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return str(path)


def _randn(*shape, seed=0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


# --- every tensor, every rank, every checkpoint --------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_reads_reproduce_every_slice(model_dir, tp):
    """Each rank's reads, run against the raw file bytes, give the slice vLLM's sharding gives that rank
    (`expected.expected_rank`: safetensors' tensors chunked by the test, not the plan's pieces)."""
    plan = make_plan(model_dir, tp)
    ref = _reference(model_dir)
    assert plan.tp == tp and [rp.rank for rp in plan.ranks] == list(range(tp))
    assert plan.skipped == ()
    for rp in plan.ranks:
        names = [t.name for t in rp.tensors]
        assert len(names) == len(set(names)), "a tensor is planned twice for one rank"
        assert sorted(names) == sorted(ref), f"rank {rp.rank} misses or invents tensors"
        want = expected_rank(ref, model_config(model_dir), rp.rank, tp)
        for shard in rp.tensors:
            full = ref[shard.name]
            assert tuple(shard.full_shape) == tuple(full.shape) and shard.dtype == "BF16"
            _check_shard_bytes(plan, shard, want[shard.name])
            # every read stays inside the tensor's own bytes
            fname, start = _layout(model_dir)[shard.name]
            for r in shard.reads:
                assert os.path.basename(plan.files[r.file].uri) == fname
                for off, _, length in read_ranges(r):
                    assert start <= off and off + length <= start + full.numel() * BF16
    if tp == 1:  # one rank reads every tensor whole, exactly once
        assert plan.bytes_read == plan.bytes_needed == plan.checkpoint_bytes


# --- hand-computed expectations ------------------------------------------------


@pytest.mark.parametrize("tp, group", [(8, 4), (4, 2)])
def test_gqa_kv_heads_are_replicated(llama_dir, tp, group):
    """2 kv heads of 8 rows: with tp > 2, rank r reads kv head r // (tp / 2), whole and contiguous."""
    plan = make_plan(llama_dir, tp)
    layout = _layout(llama_dir)
    ref = _reference(llama_dir)
    for r in range(tp):
        head = r // group
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.1.self_attn.{proj}.weight"
            shard = _shard(plan, r, name)
            assert shard.placement == "heads(kv)" and shard.shape == (8, 64)
            assert shard.pieces == ((head * 8, 0, 8),)
            (read,) = shard.reads
            assert (read.offset, read.length, read.count) == (layout[name][1] + head * 8 * 64 * BF16, 8 * 64 * BF16, 1)
            _check_shard_bytes(plan, shard, ref[name][head * 8 : head * 8 + 8])


def test_kv_heads_split_when_tp_divides_them(llama_dir):
    plan = make_plan(llama_dir, 2)
    for r in range(2):
        assert _shard(plan, r, "model.layers.0.self_attn.k_proj.weight").pieces == ((r * 8, 0, 8),)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_q_heads_split_and_column_is_one_contiguous_read(llama_dir, tp):
    plan = make_plan(llama_dir, tp)
    layout = _layout(llama_dir)
    ref = _reference(llama_dir)
    for r in range(tp):
        rows = 64 // tp  # 8 q heads of head_dim 8
        q = _shard(plan, r, "model.layers.0.self_attn.q_proj.weight")
        assert q.placement == "heads(q)" and q.pieces == ((r * rows, 0, rows),)
        for name, n_rows in (("model.layers.0.self_attn.q_proj.weight", 64), ("model.layers.0.mlp.gate_proj.weight", 128),
                             ("model.layers.0.mlp.up_proj.weight", 128), ("lm_head.weight", 256),
                             ("model.embed_tokens.weight", 256)):
            per = n_rows // tp
            shard = _shard(plan, r, name)
            (read,) = shard.reads
            assert read.count == 1 and not read.gather and read.dst_offset == 0
            assert (read.offset, read.length) == (layout[name][1] + r * per * 64 * BF16, per * 64 * BF16)
            _check_shard_bytes(plan, shard, ref[name][r * per : (r + 1) * per])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_row_parallel_is_one_strided_read_per_tensor(llama_dir, tp):
    plan = make_plan(llama_dir, tp)
    layout = _layout(llama_dir)
    ref = _reference(llama_dir)
    for r in range(tp):
        for name, (rows, cols) in (("model.layers.0.self_attn.o_proj.weight", (64, 64)),
                                   ("model.layers.1.mlp.down_proj.weight", (64, 128))):
            per = cols // tp
            shard = _shard(plan, r, name)
            assert shard.placement == "split(dim=-1)" and shard.dim == 1 and shard.shape == (rows, per)
            (read,) = shard.reads
            assert read.count == rows and not read.gather
            assert read.offset == layout[name][1] + r * per * BF16
            assert (read.length, read.stride, read.dst_offset, read.dst_stride) == (per * BF16, cols * BF16, 0, per * BF16)
            assert read.requests == rows and read.bytes_read == read.bytes_needed == rows * per * BF16
            _check_shard_bytes(plan, shard, ref[name][:, r * per : (r + 1) * per])


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_qwen2_biases_follow_their_heads(qwen2_dir, tp):
    plan = make_plan(qwen2_dir, tp)
    ref = _reference(qwen2_dir)
    for r in range(tp):
        q = _shard(plan, r, "model.layers.0.self_attn.q_proj.bias")
        rows = 64 // tp
        assert q.placement == "heads(q)" and q.pieces == ((r * rows, 0, rows),)
        _check_shard_bytes(plan, q, ref[q.name][r * rows : (r + 1) * rows])
        # 4 kv heads of 8: split for tp <= 4, head r // 2 for tp = 8
        start, length = ((r // 2) * 8, 8) if tp == 8 else (r * 32 // tp, 32 // tp)
        for proj in ("k_proj", "v_proj"):
            for kind in ("weight", "bias"):
                shard = _shard(plan, r, f"model.layers.1.self_attn.{proj}.{kind}")
                assert shard.placement == "heads(kv)" and shard.pieces == ((start, 0, length),)
                _check_shard_bytes(plan, shard, ref[shard.name][start : start + length])


# A hand-written llama-style layer with fused qkv / gate_up and row-parallel biases.
HEAD_DIM, HIDDEN, INTER = 4, 32, 16
FUSED_CONFIG = {"model_type": "llama", "hidden_size": HIDDEN, "num_attention_heads": 8, "num_key_value_heads": 2,
                "head_dim": HEAD_DIM, "intermediate_size": INTER, "num_hidden_layers": 1}


@pytest.fixture(scope="module")
def fused_dir(tmp_path_factory):
    p = "model.layers.0."
    tensors = {
        p + "self_attn.qkv_proj.weight": _randn((8 + 2 + 2) * HEAD_DIM, HIDDEN, seed=1),
        p + "self_attn.qkv_proj.bias": _randn((8 + 2 + 2) * HEAD_DIM, seed=2),
        p + "self_attn.o_proj.weight": _randn(HIDDEN, 8 * HEAD_DIM, seed=3),
        p + "self_attn.o_proj.bias": _randn(HIDDEN, seed=4),
        p + "mlp.gate_up_proj.weight": _randn(2 * INTER, HIDDEN, seed=5),
        p + "mlp.down_proj.weight": _randn(HIDDEN, INTER, seed=6),
        p + "mlp.down_proj.bias": _randn(HIDDEN, seed=7),
        p + "self_attn.rotary_emb.inv_freq": torch.arange(HEAD_DIM // 2, dtype=torch.float32),
        p + "input_layernorm.weight": _randn(HIDDEN, seed=8),
    }
    return _write_checkpoint(tmp_path_factory.mktemp("fused"), tensors, FUSED_CONFIG)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_qkv_and_gate_up(fused_dir, tp):
    plan = make_plan(fused_dir, tp)
    ref = _reference(fused_dir)
    assert plan.skipped == ("model.layers.0.self_attn.rotary_emb.inv_freq",)
    qh = 8 // tp
    for r in range(tp):
        kv = slice(r * (2 // tp) * HEAD_DIM, (r + 1) * (2 // tp) * HEAD_DIM) if tp <= 2 else \
            slice((r // (tp // 2)) * HEAD_DIM, (r // (tp // 2) + 1) * HEAD_DIM)
        for kind in ("weight", "bias"):
            name = f"model.layers.0.self_attn.qkv_proj.{kind}"
            full = ref[name]
            q, k, v = full[: 8 * HEAD_DIM], full[8 * HEAD_DIM : 10 * HEAD_DIM], full[10 * HEAD_DIM :]
            expected = torch.cat([q[r * qh * HEAD_DIM : (r + 1) * qh * HEAD_DIM], k[kv], v[kv]])
            shard = _shard(plan, r, name)
            assert shard.placement.startswith("fused(") and len(shard.reads) == 3
            assert all(rd.count == 1 for rd in shard.reads)
            assert torch.equal(reference_shard(full, shard), expected)
            _check_shard_bytes(plan, shard, expected)
        name = "model.layers.0.mlp.gate_up_proj.weight"
        full = ref[name]
        per = INTER // tp
        expected = torch.cat([full[r * per : (r + 1) * per], full[INTER + r * per : INTER + (r + 1) * per]])
        shard = _shard(plan, r, name)
        assert len(shard.reads) == 2 and all(rd.count == 1 for rd in shard.reads)
        assert torch.equal(reference_shard(full, shard), expected)
        _check_shard_bytes(plan, shard, expected)
        for name in ("model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.down_proj.bias",
                     "model.layers.0.input_layernorm.weight"):  # row-parallel biases: replicated
            shard = _shard(plan, r, name)
            assert shard.placement == "replicated" and shard.dim is None and shard.pieces == ()
            assert len(shard.reads) == 1 and shard.reads[0].length == HIDDEN * BF16
            _check_shard_bytes(plan, shard, ref[name])


@pytest.mark.parametrize("tp", [2, 4])
def test_mixtral_experts_split_router_replicated(mixtral_dir, tp):
    plan = make_plan(mixtral_dir, tp)
    ref = _reference(mixtral_dir)
    assert any(".block_sparse_moe.experts." in n for n in ref), "fixture layout changed: update this test"
    per = 64 // tp
    for r in range(tp):
        for e in range(4):
            p = f"model.layers.1.block_sparse_moe.experts.{e}."
            for w in ("w1", "w3"):  # gate / up: column-parallel
                shard = _shard(plan, r, p + w + ".weight")
                assert shard.placement == "expert(split(dim=0))" and len(shard.reads) == 1 and shard.reads[0].count == 1
                _check_shard_bytes(plan, shard, ref[shard.name][r * per : (r + 1) * per])
            shard = _shard(plan, r, p + "w2.weight")  # down: row-parallel
            assert shard.placement == "expert(split(dim=-1))" and len(shard.reads) == 1 and shard.reads[0].count == 64
            _check_shard_bytes(plan, shard, ref[shard.name][:, r * per : (r + 1) * per])
        router = _shard(plan, r, "model.layers.1.block_sparse_moe.gate.weight")
        assert router.placement == "replicated" and router.shape == (4, 64)
        _check_shard_bytes(plan, router, ref[router.name])


@pytest.fixture(scope="module")
def fused_experts_dir(tmp_path_factory):
    """transformers 5's in-memory MoE layout: experts stacked, gate and up packed."""
    tensors = {
        "model.layers.0.mlp.experts.gate_up_proj": _randn(4, 2 * INTER, HIDDEN, seed=11),
        "model.layers.0.mlp.experts.down_proj": _randn(4, HIDDEN, INTER, seed=12),
        "model.layers.0.mlp.gate.weight": _randn(4, HIDDEN, seed=13),
    }
    config = {"model_type": "mixtral", "hidden_size": HIDDEN, "num_attention_heads": 8, "num_key_value_heads": 2,
              "num_local_experts": 4, "intermediate_size": INTER}
    return _write_checkpoint(tmp_path_factory.mktemp("fused_experts"), tensors, config)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_experts(fused_experts_dir, tp):
    plan = make_plan(fused_experts_dir, tp)
    ref = _reference(fused_experts_dir)
    per = INTER // tp
    for r in range(tp):
        full = ref["model.layers.0.mlp.experts.gate_up_proj"]
        expected = torch.cat([full[:, r * per : (r + 1) * per], full[:, INTER + r * per : INTER + (r + 1) * per]], dim=1)
        shard = _shard(plan, r, "model.layers.0.mlp.experts.gate_up_proj")
        assert len(shard.reads) == 2 and all(rd.count == 4 for rd in shard.reads)  # one range per expert per part
        _check_shard_bytes(plan, shard, expected)
        full = ref["model.layers.0.mlp.experts.down_proj"]
        shard = _shard(plan, r, "model.layers.0.mlp.experts.down_proj")
        assert len(shard.reads) == 1 and shard.reads[0].count == 4 * HIDDEN
        _check_shard_bytes(plan, shard, full[:, :, r * per : (r + 1) * per])
        router = _shard(plan, r, "model.layers.0.mlp.gate.weight")
        assert router.placement == "replicated"
        _check_shard_bytes(plan, router, ref[router.name])


# --- uneven dims ---------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    """One [10, 6] float32 tensor 'w' and no config.json: rules only."""
    return _write_checkpoint(tmp_path_factory.mktemp("odd"), {"w": torch.arange(60, dtype=torch.float32).reshape(10, 6)}, None)


def test_uneven_error_names_tensor_and_numbers(odd_dir):
    with pytest.raises(IndivisibleDimError) as e:
        make_plan(odd_dir, 4, rules=[("w", Split(0))], uneven="error")
    msg = str(e.value)
    assert "'w'" in msg and "10" in msg and "tp=4" in msg and "uneven='chunk'" in msg and "model.safetensors" in msg


@pytest.mark.parametrize("tp", [3, 4, 6, 7, 12])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_uneven_chunk_follows_torch_chunk(odd_dir, tp, dim):
    plan = make_plan(odd_dir, tp, rules=[("w", Split(dim))], uneven="chunk")
    full = _reference(odd_dir)["w"]
    chunks = torch.chunk(full, tp, dim)
    empties = 0
    for r in range(tp):
        if r < len(chunks):
            expected = chunks[r]
        else:  # torch.chunk gives fewer than tp chunks: the last ranks get nothing
            expected = full.narrow(dim, 0, 0)
            empties += 1
        shard = _shard(plan, r, "w")
        _check_shard_bytes(plan, shard, expected)
        assert torch.equal(reference_shard(full, shard), expected)
        if expected.numel() == 0:
            assert shard.reads == ()
    assert empties == tp - len(chunks)


def test_uneven_chunk_per_rule_override(odd_dir):
    plan = make_plan(odd_dir, 4, rules=[("w", Split(0, uneven="chunk"))], uneven="error")
    assert [_shard(plan, r, "w").shape[0] for r in range(4)] == [3, 3, 3, 1]


@pytest.mark.parametrize("tp, pad_to, per", [(4, 1, 3), (3, 1, 4), (4, 8, 4)])
def test_uneven_pad_gives_zero_rows(odd_dir, tp, pad_to, per):
    plan = make_plan(odd_dir, tp, rules=[("w", Split(0, pad_to=pad_to))], uneven="pad")
    full = _reference(odd_dir)["w"]
    padded = torch.cat([full, torch.zeros(per * tp - 10, 6)])
    for r in range(tp):
        shard = _shard(plan, r, "w")
        assert shard.shape == (per, 6)
        _check_shard_bytes(plan, shard, padded[r * per : (r + 1) * per])
        assert torch.equal(reference_shard(full, shard), padded[r * per : (r + 1) * per])
        real = max(0, min(per, 10 - r * per))
        assert shard.bytes_needed == real * 6 * 4 and shard.nbytes == per * 6 * 4
    stats = plan.ranks[-1].stats
    assert stats.bytes_needed < stats.shard_bytes


def test_uneven_pad_last_dim(odd_dir):
    plan = make_plan(odd_dir, 4, rules=[("w", Split(-1))], uneven="pad")
    full = _reference(odd_dir)["w"]
    padded = torch.cat([full, torch.zeros(10, 2)], dim=1)
    for r in range(4):
        shard = _shard(plan, r, "w")
        _check_shard_bytes(plan, shard, padded[:, r * 2 : r * 2 + 2])


# --- rules ---------------------------------------------------------------------


def test_user_rules_override_the_preset(llama_dir):
    plan = make_plan(llama_dir, 2, rules=[("*.o_proj.weight", Replicated())])
    o = _shard(plan, 1, "model.layers.0.self_attn.o_proj.weight")
    assert o.placement == "replicated" and o.shape == (64, 64)
    assert _shard(plan, 1, "model.layers.0.self_attn.q_proj.weight").placement == "heads(q)"
    assert _shard(plan, 1, "model.layers.0.mlp.down_proj.weight").placement == "split(dim=-1)"


def test_first_matching_rule_wins(llama_dir):
    plan = make_plan(llama_dir, 2, rules=[("*.q_proj.weight", Split(-1)), ("*.q_proj.weight", Replicated()),
                                          ("*_proj.weight", Skip())])
    assert _shard(plan, 0, "model.layers.0.self_attn.q_proj.weight").placement == "split(dim=-1)"
    assert "model.layers.0.self_attn.k_proj.weight" in plan.skipped


def test_unknown_architecture_says_how_to_pass_rules(tmp_path):
    d = _write_checkpoint(tmp_path / "x", {"a.weight": torch.zeros(4)}, {"model_type": "no_such_arch"})
    with pytest.raises(UnknownArchitectureError) as e:
        make_plan(d, 2)
    msg = str(e.value)
    assert "no_such_arch" in msg and "rules=" in msg and "preset=" in msg
    plan = make_plan(d, 2, rules={"a.weight": Split(0)})  # user rules alone are enough
    assert _shard(plan, 1, "a.weight").pieces == ((2, 0, 2),)
    with pytest.raises(UnknownArchitectureError):
        make_plan(tmp_path / "x", 2, preset="no_such_preset")


def test_no_config_needs_rules(odd_dir):
    with pytest.raises(UnknownArchitectureError):
        make_plan(odd_dir, 2)


def test_unmatched_tensor(fused_dir, tmp_path):
    with pytest.raises(UnmatchedTensorError) as e:
        make_plan(fused_dir, 2, rules=[("*.qkv_proj.*", Replicated())], preset=None)
    assert "o_proj.weight" in str(e.value) and "Replicated()" in str(e.value)
    d = _write_checkpoint(tmp_path / "y", {"model.layers.0.weird.weight": torch.zeros(4),
                                           "model.norm.weight": torch.ones(4)}, {"model_type": "llama"})
    with pytest.raises(UnmatchedTensorError, match="weird"):
        make_plan(d, 2)
    assert make_plan(d, 2, rules=[("*.weird.*", Skip())]).skipped == ("model.layers.0.weird.weight",)


def test_skip_lands_in_skipped(llama_dir):
    plan = make_plan(llama_dir, 4, rules=[("lm_head.weight", Skip())])
    assert plan.skipped == ("lm_head.weight",)
    for rp in plan.ranks:
        assert "lm_head.weight" not in {t.name for t in rp.tensors}
    assert plan.ranks[0].stats.tensors == len(_reference(llama_dir)) - 1


def test_regex_rules(llama_dir):
    rx = r"model\.layers\.\d+\.self_attn\.[ov]_proj\.weight"
    plan = make_plan(llama_dir, 2, rules=[Rule(rx, Replicated(), regex=True), ("model\\.norm", Skip(), True)])
    assert _shard(plan, 0, "model.layers.1.self_attn.o_proj.weight").placement == "replicated"
    assert _shard(plan, 0, "model.layers.1.self_attn.v_proj.weight").placement == "replicated"
    assert _shard(plan, 0, "model.layers.1.self_attn.k_proj.weight").placement == "heads(kv)"
    assert "model.norm.weight" not in plan.skipped  # regexes must match the whole name
    with pytest.raises(RuleError):
        Rule("(unclosed", Replicated(), regex=True)
    assert not Rule("o_proj", Replicated(), regex=True).matches("model.layers.0.self_attn.o_proj.weight")


def test_dict_rules(llama_dir):
    plan = make_plan(llama_dir, 2, rules={"*.o_proj.weight": Replicated(), "lm_head.weight": Skip()})
    assert _shard(plan, 0, "model.layers.0.self_attn.o_proj.weight").placement == "replicated"
    assert plan.skipped == ("lm_head.weight",)
    with pytest.raises(RuleError):
        make_plan(llama_dir, 2, rules={"*": "replicated"})


def test_rule_errors_name_the_tensor(llama_dir):
    with pytest.raises(RuleError) as e:
        make_plan(llama_dir, 2, rules=[("model.norm.weight", Split(1))])
    assert "model.norm.weight" in str(e.value) and "'model.norm.weight'" in str(e.value)
    with pytest.raises(RuleError, match="dim -2 is out of range"):  # a negative dim one past the first, too
        make_plan(llama_dir, 2, rules=[("model.norm.weight", Split(-2))])
    with pytest.raises(IndivisibleDimError, match=r"_proj\.weight.*heads\((q|kv)\): tp=3"):
        make_plan(llama_dir, 3, uneven="chunk")  # heads never chunk: 3 divides neither 8 q nor 2 kv heads
    with pytest.raises(ShardingError):
        make_plan(llama_dir, 2, rules=[("model.norm.weight", Heads("q", heads=3))])


def test_fused_along_last_dim_and_mismatched_part_dims(odd_dir):
    full = _reference(odd_dir)["w"]  # [10, 6]: two packed parts of 3 columns
    plan = make_plan(odd_dir, 3, rules=[("w", Fused((Split(-1), Split(-1)), dim=-1))])
    for r in range(3):
        expected = torch.cat([full[:, r : r + 1], full[:, 3 + r : 4 + r]], dim=1)
        _check_shard_bytes(plan, _shard(plan, r, "w"), expected)
    with pytest.raises(RuleError, match=r"'w'.*fused dim 1"):  # a part split along another dim is refused
        make_plan(odd_dir, 2, rules=[("w", Fused((Split(0), Split(0)), dim=1))])


def test_presets_cover_the_fixtures():
    assert {"llama", "qwen2", "mixtral"} <= set(PRESETS)


# --- max_gap -------------------------------------------------------------------


def test_max_gap_gathers_row_reads(llama_dir):
    plain = make_plan(llama_dir, 4)
    gap = (64 - 16) * BF16  # o_proj [64, 64], 16 columns per rank
    assert plain.max_gap == 0
    below = make_plan(llama_dir, 4, max_gap=gap - 1)
    o_name = "model.layers.0.self_attn.o_proj.weight"
    assert not _shard(below, 0, o_name).reads[0].gather
    gathered = make_plan(llama_dir, 4, max_gap=gap)
    (read,) = _shard(gathered, 2, o_name).reads
    assert read.gather and read.requests == 1 and read.count == 64
    assert read.bytes_read - read.bytes_needed == 63 * gap
    # down_proj's gap (128 - 32 columns) is larger: still one request per row
    assert not _shard(gathered, 2, "model.layers.0.mlp.down_proj.weight").reads[0].gather
    for p_rank, g_rank in zip(plain.ranks, gathered.ranks):
        ps, gs = p_rank.stats, g_rank.stats
        o_reads = 2  # one o_proj per layer
        assert gs.bytes_needed == ps.bytes_needed
        assert gs.bytes_read - ps.bytes_read == o_reads * 63 * gap
        assert ps.requests - gs.requests == o_reads * 63
    everything = make_plan(llama_dir, 4, max_gap=10**9)
    files = _files(everything)
    ref = _reference(llama_dir)
    extra = 0
    for rp in everything.ranks:
        for t in rp.tensors:
            assert apply_reads(t, files) == as_bytes(reference_shard(ref[t.name], t))
            for rd in t.reads:
                assert rd.gather == (rd.count > 1)
                extra += (rd.count - 1) * (rd.stride - rd.length) if rd.gather else 0
                assert rd.requests == 1
        assert rp.stats.requests == sum(len(t.reads) for t in rp.tensors)
    assert everything.bytes_read - plain.bytes_read == extra > 0


def test_cost_model_chooses_whole_or_row_by_row_per_read(llama_dir):
    """One connection, parts larger than any tensor: a read is gathered iff its gap bytes (count - 1) x gap cost
    less at `connection_bps` than the (count - 1) requests saved, i.e. iff gap <= request_s x connection_bps."""
    from raylazy.core.costs import CostModel
    from raylazy.core.options import PlanOptions
    from raylazy.core.planner import plan_checkpoint
    from raylazy.storage import open_checkpoint

    ckpt = open_checkpoint(llama_dir)
    o_gap, down_gap = (64 - 16) * BF16, (128 - 32) * BF16  # o_proj [64, 64], down_proj [64, 128] at tp=4
    between = CostModel(request_s=1.0, connection_bps=(o_gap + down_gap) / 2)
    plan = plan_checkpoint(ckpt, PlanOptions(tp=4), cost=between)
    assert plan.max_gap is None
    assert [rp.tensors for rp in plan.ranks] == [rp.tensors for rp in make_plan(llama_dir, 4, max_gap=o_gap).ranks]
    assert _shard(plan, 1, "model.layers.0.self_attn.o_proj.weight").reads[0].gather
    assert not _shard(plan, 1, "model.layers.0.mlp.down_proj.weight").reads[0].gather
    # every byte at 1 B/s for all connections together: fetching the gaps never pays, whatever a request costs
    capped = plan_checkpoint(ckpt, PlanOptions(tp=4), cost=CostModel(request_s=1.0, connection_bps=1e9, bandwidth_bps=1))
    assert capped.bytes_read == capped.bytes_needed
    # an explicit max_gap wins over the cost model; none and no cost model (local files): exact reads
    assert plan_checkpoint(ckpt, PlanOptions(tp=4, max_gap=0), cost=between).bytes_read == capped.bytes_needed
    assert plan_checkpoint(ckpt, PlanOptions(tp=4)).max_gap == 0
    # the estimate of a rank: its requests and bytes at the model's rates
    rp = plan.ranks[1]
    requests = sum(1 if r.gather else r.count for t in rp.tensors for r in t.reads)
    assert between.rank_seconds(rp) == pytest.approx(requests * 1.0 + rp.stats.bytes_read / between.connection_bps)


# --- serialisation, tables, stats ------------------------------------------------


@pytest.fixture(scope="module")
def a_plan(llama_dir) -> Plan:
    return make_plan(llama_dir, 4, max_gap=96, rules=[("lm_head.weight", Skip())])


def test_json_round_trip(a_plan):
    text = a_plan.to_json()
    back = Plan.from_json(text)
    assert back == a_plan and back.to_json() == text
    assert Plan.from_json(a_plan.to_json(indent=2)) == a_plan
    assert Plan.from_json(text.encode()) == a_plan


def test_pickle_round_trip(a_plan):
    back = pickle.loads(pickle.dumps(a_plan))
    assert back == a_plan and back.ranks[3].stats == a_plan.ranks[3].stats


@pytest.mark.parametrize("garbage", ["", "not json", "[]", '{"root": 1}', b"\xff\xfe", "{" * 5000,
                                     '{"root": "x", "tp": "many"}'])
def test_plan_format_error(garbage):
    with pytest.raises(PlanFormatError):
        Plan.from_json(garbage)


def test_plan_format_error_on_extra_fields(a_plan):
    raw = json.loads(a_plan.to_json())
    raw["ranks"][0]["tensors"][0]["surprise"] = 1
    with pytest.raises(PlanFormatError):
        Plan.from_json(json.dumps(raw))


def test_rows_and_table(a_plan):
    rows = a_plan.to_rows()
    expected_rows = sum(max(1, len(t.reads)) for rp in a_plan.ranks for t in rp.tensors)
    assert len(rows) == expected_rows
    for rp in a_plan.ranks:
        mine = [row for row in rows if row["rank"] == rp.rank]
        s = rp.stats
        assert sum(row["bytes_needed"] for row in mine) == s.bytes_needed
        assert sum(row["bytes_read"] for row in mine) == s.bytes_read
        assert sum(row["requests"] for row in mine) == s.requests
        assert {row["tensor"] for row in mine} == {t.name for t in rp.tensors}
        assert len({row["file"] for row in mine}) == s.files
    table = a_plan.to_table()
    assert len(table) == len(rows)
    assert int(table["bytes_read"].sum()) == a_plan.bytes_read
    assert int(table["bytes_needed"].sum()) == a_plan.bytes_needed


def test_stats_and_summary(a_plan, llama_dir):
    ref = _reference(llama_dir)
    for rp in a_plan.ranks:
        s = rp.stats
        assert s.tensors == len(rp.tensors) == len(ref) - 1
        assert s.shard_bytes == sum(t.nbytes for t in rp.tensors) == s.bytes_needed  # no padding
        assert s.bytes_read >= s.bytes_needed
        assert s.requests == sum(rd.requests for t in rp.tensors for rd in t.reads)
        assert s.files == len({rd.file for t in rp.tensors for rd in t.reads})
    assert a_plan.bytes_needed == sum(rp.stats.bytes_needed for rp in a_plan.ranks)
    assert a_plan.checkpoint_bytes == sum(t.numel() * BF16 for t in ref.values())
    text = a_plan.summary()
    for rp in a_plan.ranks:
        assert re.search(rf"^\s*{rp.rank}\s+{rp.stats.tensors}\s", text, re.M), f"rank {rp.rank} missing:\n{text}"
    assert "tp=4" in text and "lm_head.weight" in text


# --- property: any shape, dtype, tp: reads cover each byte once and give torch.chunk ---


SUB_BYTE = sorted(k for k, v in DTYPE_BITS.items() if v % 8)


def _header_and_file(dtype: str, shape: tuple[int, ...], seed: int) -> tuple[bytes, int]:
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * DTYPE_BITS[dtype] // 8
    header = json.dumps({"t": {"dtype": dtype, "shape": list(shape), "data_offsets": [0, nbytes]}}).encode()
    data = bytes((seed * 131 + i * 197 + (i >> 8) * 7) % 251 for i in range(nbytes))
    return struct.pack("<Q", len(header)) + header + data, 8 + len(header)


def test_a_slice_off_whole_bytes_is_a_sharding_error_not_a_header_error():
    """A valid F4 file (2 x 2 = 2 bytes) split by columns over 2 ranks: each row's slice is half a byte."""
    blob, _ = _header_and_file("F4", (2, 2), 0)
    ckpt = Checkpoint(root="/nonexistent", files=(parse_header(blob, len(blob), "t.safetensors"),), config=ModelConfig())
    with pytest.raises(ShardingError) as info:  # what a caller catches for rules that do not fit the checkpoint
        make_plan(ckpt, 2, rules=[("t", Split(-1))], preset=None)
    err = info.value
    assert type(err) is PartialByteSliceError and isinstance(err, PartialByteError)
    assert not isinstance(err, (HeaderError, CheckpointError))
    assert "t.safetensors" in str(err) and "'t'" in str(err) and "[0:1] along dim 1" in str(err) and "F4 [2, 2]" in str(err)
    assert pickle.loads(pickle.dumps(err)).args == err.args


@settings(max_examples=200, deadline=None)
@given(held=st.lists(st.lists(st.one_of(st.none(), st.integers(0, 100)), min_size=2, max_size=2), min_size=1,
                     max_size=12),
       budget=st.integers(1, 150))
def test_batches_hold_at_most_the_budget(held, budget):
    """`batch_cuts`: every region once, in checkpoint order; no process holds more than the budget in a batch unless
    one region is all it holds there; a batch ends only where its next region would pass a process's budget."""
    sizes = [4 * max(h or 0 for h in row) + 4 for row in held]
    header = {f"t{i}": {"dtype": "F32", "shape": [n // 4], "data_offsets": [sum(sizes[:i]), sum(sizes[: i + 1])]}
              for i, n in enumerate(sizes)}
    blob = json.dumps(header).encode()
    ts = parse_header(struct.pack("<Q", len(blob)) + blob + bytes(sum(sizes)), 8 + len(blob) + sum(sizes), "f").tensors
    regions = [Region.whole(0, t) for t in ts]
    wants = [{r: row[p] for r, row in zip(regions, held) if row[p] is not None} for p in range(2)]
    batches = batch_cuts(wants, budget)
    assert [r for b in batches for r in sorted({x for part in b for x in part}, key=lambda r: r.order)] == \
        [r for r in regions if any(r in w for w in wants)]
    for b, batch in enumerate(batches):
        for p, part in enumerate(batch):
            assert sum(wants[p][r] for r in part) <= budget or sum(1 for r in part if wants[p][r]) == 1
        if b:  # cut where the first region of the batch would have passed the budget of the batch before
            first = min((r for part in batch for r in part), key=lambda r: r.order)
            before = [sum(wants[p][r] for r in part) for p, part in enumerate(batches[b - 1])]
            assert any(h and h + wants[p].get(first, 0) > budget for p, h in enumerate(before))


def test_a_box_off_whole_bytes_names_the_box():
    """A lazy weight's box of an F4 tensor cut along two dims, half a byte: the error names the box and the file."""
    blob, _ = _header_and_file("F4", (2, 4), 0)
    t = parse_header(blob, len(blob), "t.safetensors").tensors[0]
    with pytest.raises(PartialByteSliceError, match=r"t\.safetensors: tensor 't': the box \[0:1, 1:3\] of F4 \[2, 4\]"):
        Region(0, t, (0, 1), (1, 2)).shard("t", gathering(0, None), "t.safetensors")


def _bits(data: bytes) -> str:
    return "".join(f"{b:08b}" for b in data)


def _pack(bits: str) -> bytes:
    assert len(bits) % 8 == 0
    return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
    dtype=st.sampled_from(sorted(DTYPE_BITS)) | st.sampled_from(SUB_BYTE),  # sub-byte dtypes drawn more often
    tp=st.integers(1, 8),
    dim_seed=st.integers(0, 2),
    replicated=st.booleans(),
    seed=st.integers(0, 1000),
)
# A last-dim slice that is the whole dim is one contiguous run even when a row is not whole bytes.
@example(shape=(2, 1), dtype="F4", tp=1, dim_seed=1, replicated=False, seed=0)
@example(shape=(2, 1), dtype="F4", tp=2, dim_seed=1, replicated=False, seed=0)
@example(shape=(4, 3, 1), dtype="F6_E2M3", tp=3, dim_seed=2, replicated=False, seed=0)
@example(shape=(2, 4), dtype="F4", tp=2, dim_seed=1, replicated=False, seed=0)  # 2 F4 per rank per row: whole bytes
@example(shape=(2, 2), dtype="F4", tp=2, dim_seed=1, replicated=False, seed=0)  # half a byte per row: refused
def test_property_reads_cover_each_byte_once(shape, dtype, tp, dim_seed, replicated, seed):
    bits = DTYPE_BITS[dtype]
    numel = 1
    for d in shape:
        numel *= d
    assume(numel * bits % 8 == 0)  # otherwise the file itself is invalid
    dim = dim_seed % len(shape)
    blob, data_start = _header_and_file(dtype, shape, seed)
    header = parse_header(blob, len(blob), "t.safetensors")
    ckpt = Checkpoint(root="/nonexistent", files=(header,), config=ModelConfig())
    placement = Replicated() if replicated else Split(dim)
    data_bits = _bits(blob[data_start:])
    index = torch.arange(numel).reshape(shape)

    # Independent model of when a slice cannot be read as whole bytes: some contiguous
    # run of bits this rank needs starts or ends off a byte boundary (in the file or the shard).
    outer = 1
    for d in shape[:dim]:
        outer *= d
    inner_bits = bits
    for d in shape[dim + 1 :]:
        inner_bits *= d
    n = shape[dim]
    chunks = torch.chunk(index, tp, dim) if not replicated else None

    def misaligned(r: int) -> bool:
        if replicated or r >= len(chunks) or chunks[r].numel() == 0:
            return False
        take = chunks[r].shape[dim]
        start = r * (-(-n // tp))
        if take == n:  # the whole tensor: one run
            return False
        runs = [((o * n + start) * inner_bits, o * take * inner_bits) for o in range(outer)]
        return any(s % 8 or d % 8 or (take * inner_bits) % 8 for s, d in runs)

    if any(misaligned(r) for r in range(tp)):
        with pytest.raises(PartialByteError):
            make_plan(ckpt, tp, rules=[("t", placement)], preset=None, uneven="chunk")
        return
    plan = make_plan(ckpt, tp, rules=[("t", placement)], preset=None, uneven="chunk")
    info = header.tensors[0]
    cover = [0] * info.nbytes
    for rp in plan.ranks:
        shard = _shard(plan, rp.rank, "t")
        mine = [0] * info.nbytes
        for rd in shard.reads:
            assert rd.length > 0 and rd.count > 0
            for off, _dst, length in read_ranges(rd):
                for b in range(off - info.start, off - info.start + length):
                    mine[b] += 1
        if replicated:
            assert mine == [1] * info.nbytes
            expected_bits = data_bits
            assert shard.shape == shape
        else:
            cover = [a + b for a, b in zip(cover, mine)]
            part = chunks[rp.rank] if rp.rank < len(chunks) else index.narrow(dim, 0, 0)
            assert shard.shape == tuple(part.shape)
            expected_bits = "".join(data_bits[i * bits : (i + 1) * bits] for i in part.reshape(-1).tolist())
        assert apply_reads(shard, [blob]) == _pack(expected_bits)
        assert shard.bytes_needed == len(expected_bits) // 8 == shard.nbytes
    if not replicated:
        assert cover == [1] * info.nbytes


@settings(max_examples=150, deadline=None, database=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple), data=st.data(),
       max_gap=st.sampled_from([0, 1 << 20]))
def test_property_a_box_reads_its_elements_in_order(shape, data, max_gap):
    """Any box of a tensor (several dims cut, as lazy weights narrow them; `core.boxes.box_reads`, the geometry the
    planner's slices use too): its reads, run against the file, give torch's own slice of the tensor, byte for
    byte; rows are gathered only where the gap allows."""
    starts = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(data.draw(st.integers(1, n - a)) for n, a in zip(shape, starts))
    full = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.int16).reshape(shape)
    header = b"x" * 24  # the tensor's bytes start past a header
    blob = header + full.numpy().tobytes()
    region = Region(0, TensorInfo("t", "I16", shape, len(header), len(blob)), starts, sizes)
    shard = region.shard("t", gathering(max_gap, None), "t.safetensors")
    assert shard.shape == sizes
    want = full[tuple(slice(a, a + n) for a, n in zip(starts, sizes))].contiguous()
    assert apply_reads(shard, [blob]) == want.numpy().tobytes()
    assert all(r.gather == (r.stride - r.length <= max_gap) for r in shard.reads if r.count > 1)
