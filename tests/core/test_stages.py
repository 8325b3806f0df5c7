"""Pipeline stages and expert parallelism: which tensors each rank of a tp x pp mesh gets, and their bytes.

Every expectation is written here from the rules as vLLM states them, not from raylazy: the layer split of
`get_pp_indices` (the remainder one more each to the stages just before the last), the contiguous expert
blocks of `determine_expert_map` (`torch.tensor_split`: the first E % ep ranks one more), and each tensor's
tp slice as a `torch.chunk` of the full tensor safetensors reads. Shards are compared bit for bit.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import raylazy
from raylazy import cli
from raylazy.core.mesh import Coord
from raylazy.core.placements import Expert, Replicated, Skip, Split, expert_block, expert_owner
from raylazy.core.rules import Rule, read_rules
from raylazy.core.stages import layer_index, partition
from raylazy.errors import ConfigurationError, RuleError, StageError
from tests.support.checkpoints import build_checkpoint, reference_tensors
from tests.support.expected import EXPERT, expected_shard, model_config
from tests.support.planlib import apply_reads, as_bytes, read_files
from tests.support.raytest import assert_no_leaks, live, where_am_i

# --- the rules, written independently -----------------------------------------------------------


def vllm_layer_counts(layers: int, pp: int) -> list[int]:
    """Layers per stage as vLLM's get_pp_indices splits them: stage s gets one more than layers // pp when it
    is one of the `layers % pp` stages just before the last."""
    base, rem = divmod(layers, pp)
    return [base + (pp - 1 - rem <= s < pp - 1) for s in range(pp)]


def expected_stages(name: str, counts: list[int], tied: bool) -> set[int]:
    last = len(counts) - 1
    m = re.search(r"layers\.(\d+)\.", name)
    if m:
        layer, start = int(m.group(1)), 0
        for s, n in enumerate(counts):
            if start <= layer < start + n:
                return {s}
            start += n
        raise AssertionError(f"{name}: layer {layer} is in no stage of {counts}")
    if name == "model.embed_tokens.weight":
        return {0, last} if tied else {0}
    assert name in ("model.norm.weight", "lm_head.weight"), name
    return {last}


def expected_ranks(model_dir: str, tp: int, pp: int, ep: bool, tied: bool) -> list[dict[str, torch.Tensor]]:
    """Per global rank (stage-major), every tensor it must hold: those of its stage, experts of its block only."""
    cfg = model_config(model_dir)
    counts = vllm_layer_counts(cfg["num_hidden_layers"], pp)
    full = reference_tensors(model_dir)
    out = []
    for stage in range(pp):
        for rank in range(tp):
            shards = {n: expected_shard(n, t, rank, tp, ep, cfg) for n, t in full.items()
                      if stage in expected_stages(n, counts, tied)}
            out.append({n: t for n, t in shards.items() if t is not None})
    return out


def check_shards(got: list[dict[str, bytes]], want: list[dict[str, torch.Tensor]]) -> None:
    """Each rank holds exactly the tensors it must, each bit for bit."""
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), f"rank {rank}: extra {sorted(set(g) - set(w))}, missing {sorted(set(w) - set(g))}"
        for name in g:
            assert g[name] == as_bytes(w[name]), f"rank {rank}: {name}"


def check_plan(plan, model_dir: str, tp: int, pp: int, ep: bool, tied: bool) -> None:
    """The plan's ranks are stage-major, and its reads give each rank exactly its shards."""
    assert [tuple(rp.coords.values()) for rp in plan.ranks] == [(0, s, r) for s in range(pp) for r in range(tp)]
    files = read_files(plan)
    want = expected_ranks(model_dir, tp, pp, ep, tied)
    for rp, w in zip(plan.ranks, want):
        assert all(t.shape == tuple(w[t.name].shape) for t in rp.tensors if t.name in w), rp.rank
    check_shards([{t.name: apply_reads(t, files) for t in rp.tensors} for rp in plan.ranks], want)


# --- the partition and the expert blocks ------------------------------------------------------------


def test_layer_partition_is_vllms():
    # splits vLLM's get_pp_indices gives (61 layers over 2 and 4 stages: DeepSeek-V3)
    assert partition(61, 2) == (31, 30) and partition(61, 4) == (15, 15, 16, 15)
    assert partition(22, 4) == (5, 6, 6, 5) and partition(5, 3) == (2, 2, 1) and partition(3, 2) == (2, 1)
    for layers in range(1, 70):
        for pp in range(1, 9):
            assert list(partition(layers, pp)) == vllm_layer_counts(layers, pp), (layers, pp)
    assert partition(61, 2, [40, 21]) == (40, 21)
    for bad in ([40, 20], [61], [30, 30, 1]):
        with pytest.raises(ConfigurationError, match=re.escape(f"pp_layers={bad}")):
            partition(61, 2, bad)


def test_layer_index_from_names():
    assert layer_index("model.layers.12.mlp.experts.3.w1.weight") == 12
    assert layer_index("model.language_model.layers.0.input_layernorm.weight") == 0
    assert layer_index("layers.7.attention.wq.weight") == 7
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.sublayers.3.w"):
        assert layer_index(name) is None


def test_expert_blocks_are_vllms_linear_map():
    for experts in range(1, 41):
        for ranks in range(1, 10):
            blocks = torch.arange(experts).tensor_split(ranks)  # the first experts % ranks blocks one longer
            for r, block in enumerate(blocks):
                start, n = expert_block(r, ranks, experts)
                assert list(range(start, start + n)) == block.tolist(), (experts, ranks, r)
                assert all(expert_owner(e, ranks, experts) == r for e in block.tolist())
    assert [expert_block(r, 8, 256) for r in (0, 7)] == [(0, 32), (224, 32)]


# --- plans of real transformers checkpoints ----------------------------------------------------------


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Tiny Qwen2-MoE, Qwen3-MoE (tied embeddings) and DeepSeek-V3 checkpoints written by save_pretrained, and a
    Mixtral saved from transformers 5's state_dict (experts fused in one tensor per layer and projection)."""
    out = {k: build_checkpoint(k, tmp_path_factory.mktemp(k)) for k in ("qwen2_moe", "qwen3_moe", "deepseek_v3")}
    out["mixtral_fused"] = build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral_fused"), in_memory=True)
    return out


@pytest.mark.parametrize("tp, pp, ep", [(2, 2, True), (2, 2, False), (1, 2, False), (4, 1, True), (2, 1, True)])
def test_mixtral_stages_and_experts(mixtral_dir, tp, pp, ep):
    plan = raylazy.plan(mixtral_dir, tp, pp=pp, expert_parallel=ep)
    check_plan(plan, mixtral_dir, tp, pp, ep, tied=False)
    if ep:  # whole experts: nothing of an expert is read by a rank that does not hold it
        assert all(t.dim is None for rp in plan.ranks for t in rp.tensors if ".experts." in t.name)


def test_replicas_of_a_stage_grid(mixtral_dir):
    """dp=2 x pp=2 x tp=2: replica 1's ranks (4-7) hold exactly what replica 0's ranks of the same stage and tp
    rank hold."""
    plan = raylazy.plan(mixtral_dir, mesh=raylazy.Mesh(dp=2, pp=2, tp=2), expert_parallel=True)
    assert [tuple(rp.coords.values()) for rp in plan.ranks] == [(d, s, r) for d in range(2) for s in range(2)
                                                                for r in range(2)]
    check_plan(plan.model_copy(update={"ranks": plan.ranks[:4], "mesh": raylazy.Mesh(pp=2, tp=2)}), mixtral_dir,
               2, 2, True, tied=False)
    assert [rp.tensors for rp in plan.ranks[4:]] == [rp.tensors for rp in plan.ranks[:4]]


@pytest.mark.parametrize("kind, tied", [("qwen2_moe", False), ("qwen3_moe", True), ("deepseek_v3", False),
                                        ("mixtral_fused", False)])
@pytest.mark.parametrize("ep", [True, False])
def test_moe_presets_stages_and_experts(moe_dirs, kind, tied, ep):
    d = moe_dirs[kind]
    names = set(reference_tensors(d))
    assert ("lm_head.weight" not in names) == tied
    if kind == "mixtral_fused":
        assert "model.layers.0.mlp.experts.gate_up_proj" in names, "transformers no longer fuses experts in memory"
    pp = 2 if kind == "mixtral_fused" else 3  # a dense layer and MoE layers in different stages
    check_plan(raylazy.plan(d, 2, pp=pp, expert_parallel=ep), d, 2, pp, ep, tied)


def test_experts_ep_does_not_divide(moe_dirs):
    """DeepSeek tiny has 6 routed experts: over tp=4, ranks 0 and 1 get 2, ranks 2 and 3 get 1."""
    d = moe_dirs["deepseek_v3"]
    plan = raylazy.plan(d, 4, expert_parallel=True)
    held = [sorted({int(m.group(1)) for t in rp.tensors if (m := EXPERT.search(t.name))}) for rp in plan.ranks]
    assert held == [[0, 1], [2, 3], [4], [5]]
    check_plan(plan, d, 4, 1, True, tied=False)


# --- what stage rules and checkpoints can get wrong ------------------------------------------------


def _tiny(tmp_path, tensors: dict, config: dict) -> str:
    from safetensors.torch import save_file

    save_file({k: torch.randn(v) for k, v in tensors.items()}, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(tmp_path)


LLAMA_TINY = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "tie_word_embeddings": False}
TWO_LAYERS = {"model.embed_tokens.weight": (16, 8), "model.layers.0.input_layernorm.weight": (8,),
              "model.layers.1.input_layernorm.weight": (8,), "model.norm.weight": (8,), "lm_head.weight": (16, 8)}


def test_a_tensor_without_layer_or_stage_rule_is_a_stage_error(tmp_path):
    d = _tiny(tmp_path, {**TWO_LAYERS, "model.extra_proj.weight": (8, 8)}, LLAMA_TINY)
    rules = [("model.extra_proj.weight", Replicated())]
    assert raylazy.plan(d, 2, rules=rules).ranks[1].tensors  # one stage: no stage needed
    with pytest.raises(StageError, match=r"'model.extra_proj.weight' has no layer index.*stage='first'"):
        raylazy.plan(d, 1, pp=2, rules=rules)
    plan = raylazy.plan(d, 1, pp=2, rules=[Rule("model.extra_proj.weight", Replicated(), stage="last")])
    assert "model.extra_proj.weight" in {t.name for t in plan.ranks[1].tensors}
    assert "model.extra_proj.weight" not in {t.name for t in plan.ranks[0].tensors}
    plan = raylazy.plan(d, 1, pp=2, rules=[Rule("model.extra_proj.weight", Replicated(), stage="all")])
    assert all("model.extra_proj.weight" in {t.name for t in rp.tensors} for rp in plan.ranks)


def test_layers_past_the_config_and_no_layer_count(tmp_path):
    d = _tiny(tmp_path, {**TWO_LAYERS, "model.layers.2.eh_proj.weight": (8, 16)}, LLAMA_TINY)
    with pytest.raises(StageError, match=r"'model.layers.2.eh_proj.weight' is in layer 2, but the model has 2 layers"):
        raylazy.plan(d, 1, pp=2, rules=[("*eh_proj.weight", Replicated())])
    plan = raylazy.plan(d, 1, pp=2, rules=[("*layers.2.*", Skip())])  # the fix the message gives
    assert plan.skipped == ("model.layers.2.eh_proj.weight",)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({k: v for k, v in LLAMA_TINY.items() if k != "num_hidden_layers"}, f)
    with pytest.raises(StageError, match="no num_hidden_layers"):
        raylazy.plan(d, 1, pp=2, rules=[("*layers.2.*", Skip())])
    assert raylazy.plan(d, 1, pp=2, pp_layers=[1, 1], rules=[("*layers.2.*", Skip())]).ranks[1].tensors


def test_tied_embeddings_when_config_json_does_not_say(tmp_path):
    tensors = {k: v for k, v in TWO_LAYERS.items() if k != "lm_head.weight"}
    d = _tiny(tmp_path, tensors, {k: v for k, v in LLAMA_TINY.items() if k != "tie_word_embeddings"})
    plan = raylazy.plan(d, 1, pp=2)
    assert "model.embed_tokens.weight" in {t.name for t in plan.ranks[1].tensors}


def test_expert_placement_errors(tmp_path):
    d = _tiny(tmp_path, {"model.layers.0.mlp.experts.5.w1.weight": (4, 8), "model.layers.0.moe.w": (4, 8)},
              {"model_type": "x", "num_hidden_layers": 1, "num_local_experts": 4})
    rules = [("*.experts.*", Expert(Split(0))), ("*.moe.w", Expert(Split(0)))]
    with pytest.raises(RuleError, match=r"experts.5.w1.weight.*is expert 5, but the model has 4 experts"):
        raylazy.plan(d, 2, rules=rules, expert_parallel=True)
    with pytest.raises(RuleError, match=r"'model.layers.0.moe.w' names no expert.*dim=0"):
        raylazy.plan(d, 2, rules=[("*.experts.*", Expert(Split(0), experts=6))] + rules[1:], expert_parallel=True)
    plan = raylazy.plan(d, 2, rules=[("*", Expert(Split(0), experts=8))], expert_parallel=False)
    assert all(t.shape == (2, 8) for rp in plan.ranks for t in rp.tensors)  # without ep: the tp split


def test_stage_and_expert_in_rule_files(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([
        {"pattern": "*.extra", "placement": {"type": "replicated"}, "stage": "last"},
        {"pattern": "*.w", "placement": {"type": "expert", "placement": {"type": "split", "dim": 0}, "dim": 0}},
    ]))
    rules = read_rules(path)
    assert rules[0].stage == "last" and rules[1].placement == Expert(Split(0), dim=0)
    assert Expert(Split(-1), dim=0).to_dict() == {"type": "expert", "placement": {"type": "split", "dim": -1}, "dim": 0}
    path.write_text(json.dumps([{"pattern": "*", "placement": {"type": "replicated"}, "stage": "middle"}]))
    with pytest.raises(RuleError, match="stage 'middle' is not one of first, last, all, embedding"):
        read_rules(path)


def test_options_from_plan_load_and_cli(mixtral_dir, capsys):
    with pytest.raises(ConfigurationError, match=r"pp_layers=\[1\] gives 1 stage\(s\), the mesh has pp=2"):
        raylazy.load(mixtral_dir, 2, pp=2, pp_layers=[1])  # refused before Ray starts
    with pytest.raises(ConfigurationError, match="not both"):
        raylazy.plan(mixtral_dir, pp=2, mesh=raylazy.Mesh(tp=2))
    assert cli.main(["plan", mixtral_dir, "--tp", "2", "--pp", "2", "--pp-layers", "1,1", "--expert-parallel"]) == 0
    out = capsys.readouterr().out
    assert "tp=2, pp=2" in out and re.search(r"^\s+3\s+15\s", out, re.M), out  # rank 3: 15 tensors


# --- on a cluster: each stage on one node ------------------------------------------------------------


@pytest.mark.ray
class TestStagesOnNodes:
    """Two Ray nodes on this machine, each with 2 CPUs and 2 logical GPUs: tp=2 x pp=2, one stage per node."""

    @pytest.mark.parametrize("fixture, ep", [("llama_dir", False), ("mixtral_dir", True)])
    def test_tp2_pp2(self, two_node_cluster, request, fixture, ep):
        import ray

        model_dir = request.getfixturevalue(fixture)
        before = live()
        with raylazy.load(model_dir, 2, pp=2, expert_parallel=ep, use_gpu=True, device="cpu", progress=False,
                          placement_timeout_s=120) as loaded:
            assert loaded.mesh == [Coord(r, 0, r // 2, r % 2) for r in range(4)]
            nodes = [info.node_id for info in loaded.ranks]
            assert [i["node_id"] for i in ray.get(loaded.run(where_am_i), timeout=120)] == nodes
            assert nodes[0] == nodes[1] != nodes[2] == nodes[3], f"each stage on a node of its own: {nodes}"
            assert len(loaded.group.placement_groups) == 2
            for stage, pg in enumerate(loaded.group.placement_groups):
                table = ray.util.placement_group_table(pg)
                assert table["strategy"] == "STRICT_PACK" and set(table["bundles_to_node_id"].values()) == {nodes[2 * stage]}
            shards = ray.get(loaded.refs(), timeout=120)
            check_shards([{n: as_bytes(t) for n, t in s.items()} for s in shards],
                         expected_ranks(model_dir, 2, 2, ep, tied=False))
        assert_no_leaks(before, "a tp=2 x pp=2 load")
