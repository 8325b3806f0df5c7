"""Rule files (`--rules FILE`): a checkpoint no preset covers, planned and loaded from the command line.

The expected shards are slices of what safetensors' `get_tensor` reads, cut here
with `narrow`, independently of the plan.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from raylazy import cli
from raylazy.cluster.loader import LoadedModel
from raylazy.core.placements import Fused, Heads, Replicated, Skip, Split
from raylazy.core.plans import Plan
from raylazy.core.rules import Rule, read_rules
from raylazy.errors import RuleError, RuleFileError
from tests.support import REPO
from tests.support.checkpoints import reference_tensors
from tests.support.planlib import apply_reads, as_bytes, read_files

TP = 2

#: The rules for the Llama fixture's tensor names, and the dim each one splits (None: whole, "skip").
RULES = [
    ({"pattern": "*.self_attn.q_proj.weight", "placement": {"type": "heads", "kind": "q"}}, 0),
    ({"pattern": "*.self_attn.[kv]_proj.weight", "placement": {"type": "heads", "kind": "kv"}}, 0),  # 2 kv heads
    ({"pattern": "*.o_proj.weight", "placement": {"type": "split", "dim": -1}}, 1),
    ({"pattern": r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", "regex": True,
      "placement": {"type": "split", "dim": 0}}, 0),
    ({"pattern": "*.down_proj.weight", "placement": {"type": "split", "dim": -1}}, 1),
    ({"pattern": "*norm.weight", "placement": {"type": "replicated"}}, None),
    ({"pattern": "model.embed_tokens.weight", "placement": {"type": "skip"}}, "skip"),
    ({"pattern": "lm_head.weight", "placement": {"type": "split", "dim": 0}}, 0),
]


@pytest.fixture(scope="module")
def custom_dir(llama_dir, tmp_path_factory):
    """The Llama fixture with a model_type no preset knows."""
    d = str(tmp_path_factory.mktemp("custom") / "model")
    shutil.copytree(llama_dir, d)
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "my_own_arch"
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rules") / "rules.json"
    path.write_text(json.dumps([entry for entry, _ in RULES], indent=1))
    return str(path)


def _expected(model_dir: str) -> list[dict]:
    """Per rank, {name: expected shard} from get_tensor + narrow; skipped tensors absent."""
    ref = reference_tensors(model_dir)
    out = [{} for _ in range(TP)]
    for name, full in ref.items():
        dim = next(d for entry, d in RULES if Rule(entry["pattern"], Replicated(), entry.get("regex", False)).matches(name))
        for rank in range(TP):
            if dim == "skip":
                continue
            if dim is None:
                out[rank][name] = full
            else:
                per = full.shape[dim] // TP
                out[rank][name] = full.narrow(dim, rank * per, per)
    return out


def test_read_rules_gives_the_placements(rules_file):
    rules = read_rules(rules_file)
    assert [r.placement for r in rules] == [Heads("q"), Heads("kv"), Split(-1), Split(0), Split(-1), Replicated(), Skip(),
                                            Split(0)]
    assert [r.regex for r in rules] == [False, False, False, True, False, False, False, False]


def test_fused_and_options_in_a_rules_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps([
        {"pattern": "*.qkv_proj.*", "placement": {"type": "fused", "parts": [
            {"type": "heads", "kind": "q"}, {"type": "heads", "kind": "kv"}, {"type": "heads", "kind": "kv"}]}},
        {"pattern": "*.experts.gate_up_proj", "placement": {"type": "fused", "dim": 1,
                                                            "parts": [{"type": "split", "dim": 1}] * 2}},
        {"pattern": "lm_head.weight", "placement": {"type": "split", "dim": 0, "uneven": "pad", "pad_to": 64}},
    ]))
    assert [r.placement for r in read_rules(path)] == [
        Fused((Heads("q"), Heads("kv"), Heads("kv"))), Fused((Split(1), Split(1)), dim=1),
        Split(0, uneven="pad", pad_to=64)]


def test_cli_plan_with_rules_reproduces_every_shard(custom_dir, rules_file, capsys):
    assert cli.main(["plan", custom_dir, "--tp", str(TP)]) == 2  # no preset covers it
    assert "UnknownArchitectureError" in capsys.readouterr().err
    assert cli.main(["plan", custom_dir, "--tp", str(TP), "--rules", rules_file, "--json", "-"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.skipped == ("model.embed_tokens.weight",)
    files = read_files(plan)
    for rp, expected in zip(plan.ranks, _expected(custom_dir)):
        assert sorted(t.name for t in rp.tensors) == sorted(expected)
        for t in rp.tensors:
            assert apply_reads(t, files) == as_bytes(expected[t.name]), f"rank {rp.rank}: {t.name}"


def test_cli_load_with_rules_gives_the_shards(custom_dir, rules_file, ray_local, monkeypatch, capsys):
    got = []
    release = LoadedModel.release

    def keep_then_release(self):  # the CLI releases the load before returning: copy the shards first
        got.extend(self.get(r) for r in range(len(self.actors)))
        release(self)

    monkeypatch.setattr(LoadedModel, "release", keep_then_release)
    assert cli.main(["load", custom_dir, "--tp", str(TP), "--rules", rules_file, "--device", "cpu",
                     "--no-progress"]) == 0, capsys.readouterr().err
    assert len(got) == TP
    for shards, expected in zip(got, _expected(custom_dir)):
        assert sorted(shards) == sorted(expected)
        for name, t in shards.items():
            assert as_bytes(t) == as_bytes(expected[name]), name


OK = {"pattern": "*norm.weight", "placement": {"type": "replicated"}}

BAD_FILES = [
    ("{", None, "cannot read it as JSON"),
    ('{"*": {"type": "replicated"}}', None, "expected a JSON list of rules"),
    ([OK, 7], "entry 1", "expected an object"),
    ([{"pattern": "*.w"}], "entry 0 ('*.w')", "got keys ['pattern']"),
    ([OK, {"pattern": "*.w", "placement": {"type": "replicated"}, "regexp": True}], "entry 1 ('*.w')", "'regexp'"),
    ([{"pattern": 3, "placement": {"type": "skip"}}], "entry 0 (3)", '"pattern" must be a string'),
    ([{"pattern": "*.w", "placement": {"type": "skip"}, "regex": "yes"}], "entry 0 ('*.w')", "'yes'"),
    ([{"pattern": "(", "placement": {"type": "skip"}, "regex": True}], "entry 0 ('(')", "not a valid regular expression"),
    ([OK, OK, {"pattern": "*.q", "placement": {"type": "shard", "dim": 0}}], "entry 2 ('*.q')",
     "unknown placement type 'shard' (known: "),
    ([{"pattern": "*.q", "placement": "split"}], "entry 0 ('*.q')", 'a placement is an object with a "type"'),
    ([{"pattern": "*.q", "placement": {"type": "split", "dim": "0"}}], "entry 0 ('*.q')", "split: dim='0'"),
    ([{"pattern": "*.q", "placement": {"type": "split"}}], "entry 0 ('*.q')", "missing field 'dim'"),
    ([{"pattern": "*.q", "placement": {"type": "split", "dim": 0, "dims": 1}}], "entry 0 ('*.q')",
     "unknown field 'dims' (fields: dim, uneven, pad_to)"),
    ([{"pattern": "*.q", "placement": {"type": "heads", "kind": "k"}}], "entry 0 ('*.q')", "kind='k'"),
    ([{"pattern": "*.q", "placement": {"type": "split", "dim": 0, "uneven": "spread"}}], "entry 0 ('*.q')",
     "uneven='spread'"),
    ([{"pattern": "*.qkv", "placement": {"type": "fused", "parts": [{"type": "split", "dim": 0}, 7]}}],
     "entry 0 ('*.qkv')", "parts.1=7"),
    ([{"pattern": "*.qkv", "placement": {"type": "fused", "parts": [{"type": "heads"}]}}], "entry 0 ('*.qkv')",
     "heads: missing field 'kind'"),
]


@pytest.mark.parametrize("content, entry, problem", BAD_FILES)
def test_invalid_rules_files_name_the_entry(tmp_path, llama_dir, capsys, content, entry, problem):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(RuleFileError) as e:
        read_rules(path)
    msg = str(e.value)
    assert isinstance(e.value, RuleError) and str(path) in msg and problem in msg
    if entry:
        assert f"{entry}: " in msg
    for command in ("plan", "load"):  # the CLI says the same and exits 2, before starting Ray
        assert cli.main([command, llama_dir, "--tp", "2", "--rules", str(path)]) == 2
        err = capsys.readouterr().err
        assert "RuleFileError" in err and problem in err


def test_missing_rules_file(tmp_path):
    with pytest.raises(RuleFileError, match="nope.json: cannot read"):
        read_rules(tmp_path / "nope.json")


def test_the_rules_page_example_is_a_valid_rules_file(tmp_path):
    with open(os.path.join(str(REPO), "docs", "rules.md")) as f:
        page = f.read()
    example = page.split("```json\n", 1)[1].split("```", 1)[0]
    (tmp_path / "rules.json").write_text(example)
    rules = read_rules(tmp_path / "rules.json")
    assert rules[2].placement == Fused((Heads("q"), Heads("kv"), Heads("kv")))
    assert rules[4].regex and rules[4].matches("model.layers.12.mlp.down_proj.weight")
