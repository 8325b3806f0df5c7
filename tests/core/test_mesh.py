"""The mesh, planning options validated in one place, and the open set of placements.

Shards are checked bit for bit against tensors safetensors reads, sliced here
with plain torch indexing, not with anything raylazy computed.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
import torch

import raylazy
from raylazy import cli
from raylazy.core.mesh import DIMS, Mesh
from raylazy.core.options import PlanOptions, load_options, validated
from raylazy.core.placements import (
    PLACEMENT_TYPES,
    Fused,
    Heads,
    Piece,
    Placement,
    Replicated,
    Slicing,
    Split,
    placement_from_dict,
)
from raylazy.core.plans import Plan
from raylazy.core.rules import Rule, read_rules
from raylazy.errors import ConfigurationError, RuleError
from raylazy.planning import make_plan
from tests.support.checkpoints import reference_tensors
from tests.support.planlib import apply_reads, as_bytes, read_files

# --- the mesh --------------------------------------------------------------------


def test_mesh_ranks_and_coordinates():
    m = Mesh(pp=2, dp=3, tp=4)
    assert m.size == 24 and m.shape == {"dp": 3, "pp": 2, "tp": 4} and tuple(m.shape) == DIMS
    # row-major, replica outermost, tp fastest: rank = (dp * pp_size + pp) * tp_size + tp
    for rank in range(24):
        c = m.coords(rank)
        assert rank == (c["dp"] * 2 + c["pp"]) * 4 + c["tp"]
        assert m.rank(**c) == rank
        assert m.coord(rank) == (rank, c["dp"], c["pp"], c["tp"])
    assert m.coord(13).replica == 1 and m.coord(13).stage == 1 and m.coord(13).tp_rank == 1
    assert m.coords(5) == {"dp": 0, "pp": 1, "tp": 1} and m.rank(dp=1) == 8
    assert repr(m) == "Mesh(dp=3, pp=2, tp=4)" and Mesh() == Mesh(tp=1) and Mesh(tp=8) == Mesh(tp=8)
    with pytest.raises(ConfigurationError, match="rank 24"):
        m.coords(24)
    with pytest.raises(ConfigurationError, match="tp=4"):
        m.rank(tp=4)
    with pytest.raises(ConfigurationError, match="xp"):
        m.rank(xp=0)


@pytest.mark.parametrize("dims, bad", [({"tp": 0}, "tp=0"), ({"tp": "8"}, "tp='8'"), ({"tp": True}, "tp=True"),
                                       ({"pp": -1}, "pp=-1"), ({"xp": 2}, "xp=2")])
def test_bad_mesh_is_a_configuration_error(dims, bad):
    with pytest.raises(ConfigurationError, match=bad):
        Mesh(**dims)


def test_plan_records_its_mesh(llama_dir):
    plan = make_plan(llama_dir, mesh=Mesh(tp=4))
    assert plan == make_plan(llama_dir, 4)
    assert plan.mesh == Mesh(tp=4) and plan.tp == 4
    for rp in plan.ranks:
        assert rp.mesh == plan.mesh and rp.tp == 4 and rp.coords == {"dp": 0, "pp": 0, "tp": rp.rank}
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.mesh == Mesh(tp=4) and back.ranks[3].coords["tp"] == 3
    assert pickle.loads(pickle.dumps(plan)).ranks[2].coords == plan.ranks[2].coords


# --- one validation path: plan, load and the CLI ----------------------------------------


BAD_OPTIONS = [({"tp": 0}, "tp=0"), ({"tp": 2.0}, "tp=2.0"), ({"tp": 2, "max_gap": -1}, "max_gap=-1"),
               ({"tp": 2, "uneven": "spread"}, "uneven='spread'"), ({"tp": 2, "preset": 3}, "preset=3")]


@pytest.mark.parametrize("kwargs, bad", BAD_OPTIONS)
def test_bad_planning_options_are_configuration_errors_from_plan_and_load(llama_dir, kwargs, bad):
    with pytest.raises(ConfigurationError, match=bad):
        raylazy.plan(llama_dir, **kwargs)
    with pytest.raises(ConfigurationError, match=bad):  # refused before Ray starts
        raylazy.load(llama_dir, **kwargs)


@pytest.mark.parametrize("command", ["plan", "load"])
@pytest.mark.parametrize("args, bad", [(["--tp", "0"], "tp=0"), (["--max-gap", "-1"], "max_gap=-1")])
def test_bad_planning_options_from_the_cli(llama_dir, capsys, command, args, bad):
    assert cli.main([command, llama_dir, *args]) == 2
    err = capsys.readouterr().err
    assert "ConfigurationError" in err and bad in err


def test_tp_or_mesh_not_both_and_one_rank_by_default(llama_dir):
    with pytest.raises(ConfigurationError, match="not both"):
        make_plan(llama_dir, tp=2, mesh=Mesh(tp=2))
    assert make_plan(llama_dir).mesh == Mesh(tp=1) == load_options().plan.mesh


def test_validated_names_every_bad_field():
    with pytest.raises(ConfigurationError) as e:
        validated(PlanOptions, tp=2, max_gap=-1, uneven="x", surprise=1)
    msg = str(e.value)
    assert "max_gap=-1" in msg and "uneven='x'" in msg and "surprise=1" in msg
    assert validated(PlanOptions, mesh=Mesh(tp=3)).tp == 3
    with pytest.raises(ConfigurationError, match="threads=0"):
        load_options(tp=2, threads=0)


# --- the open set of placements ------------------------------------------------------


SEEN: list[tuple[str, dict]] = []


@dataclass(frozen=True)
class EveryNth(Placement, type_name="test-every-nth"):
    """A placement raylazy does not know: rank r of tp takes entries r, r + tp, r + 2 tp... along `dim`."""

    dim: int = 0

    def describe(self) -> str:
        return f"every-nth(dim={self.dim})"

    def slicing(self, shape, ctx):
        SEEN.append((ctx.name, dict(ctx.coords)))
        n = shape[self.dim] // ctx.tp
        return Slicing(self.dim, n, tuple(Piece(ctx.rank + i * ctx.tp, i, 1) for i in range(n)))


def test_a_user_placement_plans_like_the_builtin_ones(llama_dir):
    ref = reference_tensors(llama_dir)
    q, gate = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate_proj.weight"
    SEEN.clear()
    rules = [(q, EveryNth()), (gate, Fused((EveryNth(), EveryNth())))]
    plan = make_plan(llama_dir, 4, rules=rules)
    files = read_files(plan)
    assert {(name, c["tp"]) for name, c in SEEN} == {(n, r) for n in (q, gate) for r in range(4)}
    assert all(c == {"dp": 0, "pp": 0, "tp": c["tp"]} for _, c in SEEN)
    g0, g1 = ref[gate][:64], ref[gate][64:]  # gate_proj [128, 64] read as two packed parts of 64 rows
    for rank, rp in enumerate(plan.ranks):
        by_name = {t.name: t for t in rp.tensors}
        assert by_name[q].placement == "every-nth(dim=0)"
        assert apply_reads(by_name[q], files) == as_bytes(ref[q][rank::4])
        assert apply_reads(by_name[gate], files) == as_bytes(torch.cat([g0[rank::4], g1[rank::4]]))


def test_placements_round_trip_through_dicts(tmp_path):
    for p in (Replicated(), Split(-1), Split(0, uneven="pad", pad_to=64), Heads("kv", heads=4),
              Fused((Heads("q"), Heads("kv"), Heads("kv"))), Fused((EveryNth(1), Split(1)), dim=1), EveryNth(1)):
        assert placement_from_dict(p.to_dict()) == p
    assert Split(-1).to_dict() == {"type": "split", "dim": -1}
    assert Fused((Split(0), Split(0))).to_dict() == {"type": "fused", "parts": [{"type": "split", "dim": 0}] * 2}
    assert PLACEMENT_TYPES["test-every-nth"] is EveryNth
    (tmp_path / "rules.json").write_text('[{"pattern": "*", "placement": {"type": "test-every-nth", "dim": 1}}]')
    assert read_rules(tmp_path / "rules.json")[0].placement == EveryNth(1)  # a registered user class in a rule file


def test_type_names_are_unique_and_rules_want_placements(llama_dir):
    with pytest.raises(RuleError, match="already taken"):
        type("Again", (Split,), {}, type_name="split")
    with pytest.raises(RuleError, match="is not a placement"):
        raylazy.plan(llama_dir, 2, rules=[Rule("*", "replicated")])
