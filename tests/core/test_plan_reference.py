"""The planner's shortcuts change no plan: a DeepSeek-V3-shaped checkpoint (headers only, as
benchmarks/plan_deepseek.py writes it: FP8 block scales, 256 experts, the MTP layer) planned by `make_plan` and by
a straightforward reference that asks every placement about every tensor and rank, matches each name against
each rule in order and reads each header's JSON as it stands.

The reference shares with the planner only what each tensor's answer is made of (the placements, the
quantization format's `companion`, `tensor_shard`'s byte geometry, the mesh and `partition`): the planner's
shared cuts, lists in file order, cached rule matches and column-wise header checks are what it checks.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raylazy.core.boxes import gathering
from raylazy.core.header import TensorInfo
from raylazy.core.placements import Placement, ShardContext
from raylazy.core.planner import tensor_shard
from raylazy.core.quantization import Following
from raylazy.core.rules import _INDEX, Rule, _skeletons, builtin_rules
from raylazy.core.stages import partition
from raylazy.planning import make_plan
from raylazy.storage import open_checkpoint
from tests.core.test_collector import in_oldest
from tests.support import REPO

LAYERS = 5  # 3 dense, 2 of 256 experts, then the MTP layer (5)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = os.path.join(str(REPO), "benchmarks", "plan_deepseek.py")
    spec = importlib.util.spec_from_file_location("plan_deepseek", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("deepseek")
    mod.write_checkpoint(str(out), layers=LAYERS, num_files=7)
    return str(out)


def _layer(name: str) -> int | None:
    """The number after the name's first `layers` segment, read segment by segment."""
    parts = name.split(".")
    return next((int(b) for a, b in zip(parts, parts[1:]) if a == "layers" and b.isdigit()), None)


def reference_plan(ckpt, tp: int, pp: int, expert_parallel: bool, keep_mtp: bool) -> tuple[list[list], list[str]]:
    """Every rank's shards and the names skipped, tensor by tensor and rank by rank, nothing cached."""
    cfg, rules = ckpt.config, builtin_rules(ckpt.config.model_type)
    by_name = {t.name: t for f in ckpt.files for t in f.tensors}
    stage_of = [s for s, n in enumerate(partition(cfg.num_hidden_layers, pp)) for _ in range(n)]
    gather, ranks, skipped = gathering(0, None), [[] for _ in range(tp * pp)], []
    for fi, f in enumerate(ckpt.files):
        for t in f.tensors:
            layer = _layer(t.name)
            if not keep_mtp and layer is not None and layer >= cfg.num_hidden_layers:
                skipped.append(t.name)
                continue
            c = cfg.quantization.companion(t.name, by_name)
            weight = c.weight if c else t.name
            rule = next(r for r in rules if r.matches(weight))
            placement = Following(rule.placement, c.layout) if c else rule.placement
            if layer is None:
                stages = {"first": [0], "last": [pp - 1], "embedding": [0]}[
                    next(r.stage for r in rules if r.stage and r.matches(weight))]
            else:
                stages = [stage_of[layer] if layer < len(stage_of) else pp - 1]
            for s in stages:
                ctx = [ShardContext(k, tp, cfg.num_attention_heads, cfg.num_key_value_heads, "error", weight,
                                    {"dp": 0, "pp": s, "tp": k}, expert_parallel, cfg.num_experts) for k in range(tp)]
                holders = placement.holders(t.shape, ctx[0])
                for k in range(tp) if holders is None else holders:
                    ranks[s * tp + k].append(tensor_shard(fi, t, placement.describe(),
                                                          placement.slicing(t.shape, ctx[k]), gather))
    return ranks, skipped


@pytest.mark.parametrize("tp, pp, expert_parallel, keep_mtp", [(8, 2, True, False), (4, 2, True, True),
                                                               (8, 1, False, False)])
def test_the_plan_is_the_reference_plan(deepseek_dir, tp, pp, expert_parallel, keep_mtp):
    plan = make_plan(deepseek_dir, tp, pp=pp, expert_parallel=expert_parallel, keep_mtp=keep_mtp)
    ranks, skipped = reference_plan(open_checkpoint(deepseek_dir), tp, pp, expert_parallel, keep_mtp)
    assert list(plan.skipped) == skipped and (len(skipped) > 1000) != keep_mtp
    assert [rp.rank for rp in plan.ranks] == [k + tp * s for s in range(pp) for k in range(tp)]
    for rp, want in zip(plan.ranks, ranks):
        assert list(rp.tensors) == want, f"rank {rp.rank}"
    assert sum(len(rp.tensors) for rp in plan.ranks) > 3000
    for rp in plan.ranks:  # the cuts the planner made once per shape and moved: each expert's shard its own bytes
        shards = [t for t in rp.tensors if ".experts." in t.name]
        assert len({(t.file, t.reads) for t in shards}) == len(shards)


def test_headers_are_their_json(deepseek_dir):
    """Each file's tensors as its JSON header lists them, in byte order, from the checked column-wise path."""
    ckpt = open_checkpoint(deepseek_dir)
    for f in ckpt.files:
        with open(f.path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__")
        want = sorted((TensorInfo(k, v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0],
                                  8 + n + v["data_offsets"][1]) for k, v in header.items()),
                      key=lambda t: (t.start, t.end))
        assert list(f.tensors) == want and all(type(t) is TensorInfo for t in f.tensors)
    assert sum(len(f.tensors) for f in ckpt.files) > 4000


def test_a_placement_that_reads_names_is_asked_for_every_tensor(deepseek_dir):
    """A placement that does not say it slices by shape alone (`Placement.shape_only`) is asked once per tensor
    and rank, with the tensor's name (a scale's, its weight's): the experts share no cut."""
    seen = []

    class Named(Placement):
        def describe(self) -> str:
            return "named"

        def slicing(self, shape, ctx):
            seen.append((ctx.name, ctx.rank))
            return None

    pattern = r".*\.experts\.\d+\.(gate|up|down)_proj\.weight"
    plan = make_plan(deepseek_dir, 2, rules=[Rule(pattern, Named(), regex=True)])
    names = [t.name for t in plan.ranks[0].tensors if re.fullmatch(pattern, t.name)]
    assert len(names) == 2 * 256 * 3  # the MoE layers 3 and 4; the MTP layer is skipped
    assert Counter(seen) == {(n, k): 2 for n in names for k in range(2)}  # the weight, then its block scale


@given(st.lists(st.text(alphabet="ab1٣.\n", max_size=10), max_size=6))
def test_names_matched_together_have_the_skeletons_each_has_alone(names):
    """Rules match a checkpoint's names by their skeletons, worked out in one pass over all the names joined: the
    same as each name's own (index segments as `*`), whatever dots, digits and newlines the names hold."""
    assert _skeletons(names) == [_INDEX.sub("*", n) for n in names]


def test_planning_hands_the_garbage_collector_back_as_it_found_it(deepseek_dir):
    """Planning pauses the cyclic collector; afterwards it is on again only if it was, a process's own frozen
    objects stay frozen, and a plan of thousands of tensors waits in the oldest generation (no young pass over all
    of it: tests/core/test_collector.py)."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    plan = make_plan(deepseek_dir, 2)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert in_oldest(plan.ranks[0].tensors[0])

    gc.disable()
    try:
        make_plan(deepseek_dir, 2)
        assert not gc.isenabled()
    finally:
        gc.enable()

    gc.freeze()  # as a pre-fork server does with its own objects
    try:
        frozen = gc.get_freeze_count()
        make_plan(deepseek_dir, 2)
        # still frozen (an unfreeze empties it), and nothing of planning's added (a frozen object freed meanwhile leaves)
        assert gc.isenabled() and 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
