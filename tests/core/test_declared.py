"""Placements from the tensor-parallel plans transformers declares (raylazy.core.declared), against oracles raylazy
did not compute: transformers' own tensor-parallel loading, and the table against the installed transformers.

Tiny random checkpoints are written by transformers itself (`AutoConfig.for_model(type, **small sizes)`,
`from_config`, `save_pretrained` in several shards: no downloads). `torchrun --standalone --nproc-per-node 2`
runs tests/support/hf_tp_worker.py, which loads each with `from_pretrained(dir, tp_plan="auto")` over gloo and writes each
rank's part of every tensor under its disk name; each rank's raylazy shard (its plan's reads run on the files'
bytes) must equal that part bit for bit. Where transformers' choice is a training-time one that an engine does
not make, the test holds raylazy to the engine (vLLM's parallel layers), with the expected slice written here
(`ENGINE`), and checks that transformers' part differs from it: a fused q|k|v or gate|up that transformers splits
contiguously and then gathers, layers its plan leaves replicated that engines shard (gpt-oss's attention and
experts, DeepSeek-V3's latent attention, Qwen2-MoE's shared expert), a kv head fewer than the ranks (transformers
cuts it, engines replicate it).

The suite runs `SUITE`; `python -m pytest tests/core/test_declared.py -m matrix` runs every architecture of `ARCHS`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import raylazy
from benchmarks.harness.tiny_checkpoints import write_checkpoint
from raylazy.core.declared import transformers_version
from raylazy.core.placements import Replicated
from raylazy.core.rules import Rule, _first_match, planned_types
from raylazy.errors import UnknownArchitectureError
from tests.support import REPO
from tests.support.checkpoints import reference_tensors
from tests.support.planlib import apply_reads, as_bytes, read_files

pytestmark = pytest.mark.own_processes  # transformers' tensor-parallel loading under torchrun

TP = 2
#: The development tools (tools/declared_plans.py: the table's generator).
TOOLS = REPO / "tools"
#: Architecture -> (model type, sizes beyond `tiny_checkpoints.SMALL`).
ARCHS: dict[str, tuple[str, dict]] = {t: (t, {}) for t in (
    "apertus", "arcee", "codegen", "cohere", "cohere2", "deepseek_v2", "deepseek_v3", "ernie4_5", "exaone4", "gemma",
    "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe", "gpt_neox", "gpt_oss", "gptj", "granite", "granitemoe",
    "helium", "internlm3", "llama", "minimax", "ministral3", "mistral", "mixtral", "olmo", "olmo2", "olmo3", "olmoe",
    "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "starcoder2",
    "vaultgemma")}
ARCHS["llama-mqa"] = ("llama", {"num_key_value_heads": 1})
#: What the suite runs: each kind of declaration and disk layout once.
SUITE = ("llama", "llama-mqa", "gemma2", "phi3", "gpt_neox", "starcoder2", "mixtral", "qwen2_moe", "granitemoe",
         "deepseek_v3", "gpt_oss", "gptj")


def _even(t: torch.Tensor, dim: int, rank: int, tp: int = TP) -> torch.Tensor:
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def _halves(t: torch.Tensor, rank: int) -> torch.Tensor:
    """vLLM's MergedColumnParallelLinear on a fused gate|up: this rank's rows of each half."""
    return torch.cat([_even(h, 0, rank) for h in t.chunk(2, 0)])


def _qkv(t: torch.Tensor, rank: int) -> torch.Tensor:
    """vLLM's QKVParallelLinear on a fused q|k|v (4 query heads, 2 kv heads of 16): this rank's heads of each."""
    q, k, v = t.split([4 * 16, 2 * 16, 2 * 16])
    return torch.cat([_even(q, 0, rank), _even(k, 0, rank), _even(v, 0, rank)])


_ROWS, _COLS, _WHOLE = (lambda t, r: _even(t, 0, r)), (lambda t, r: _even(t, -1, r)), (lambda t, r: t)
#: Where an engine shards otherwise than transformers' tensor-parallel loading: (architecture, end of the tensor
#: name) -> the engine's slice of the full tensor for a rank.
ENGINE = {
    ("phi3", ".self_attn.qkv_proj.weight"): _qkv,  # colwise_gather_output: transformers cuts q|k|v, then gathers
    **{(a, ".mlp.gate_up_proj.weight"): lambda t, r: _halves(t, r) for a in ("phi3", "glm", "glm4")},
    **{("qwen2_moe", f".mlp.shared_expert.{p}_proj.weight"): _ROWS for p in ("gate", "up")},  # replicated by its plan
    ("qwen2_moe", ".mlp.shared_expert.down_proj.weight"): _COLS,
    **{("deepseek_v3", f".self_attn.{p}.weight"): _ROWS for p in ("q_b_proj", "kv_b_proj")},  # its plan: MLPs only
    ("deepseek_v3", ".self_attn.o_proj.weight"): _COLS,
    **{("gpt_oss", f".self_attn.{p}"): _ROWS for p in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                                        "v_proj.weight", "v_proj.bias", "sinks")},  # plan: embeddings
    ("gpt_oss", ".self_attn.o_proj.weight"): _COLS,
    ("gpt_oss", ".mlp.experts.gate_up_proj"): lambda t, r: _even(t, -1, r),  # [E, H, 2I], (gate, up) interleaved
    ("gpt_oss", ".mlp.experts.gate_up_proj_bias"): lambda t, r: _even(t, -1, r),
    ("gpt_oss", ".mlp.experts.down_proj"): lambda t, r: _even(t, 1, r),  # [E, I, H]
    **{("llama-mqa", f".self_attn.{p}_proj.weight"): _WHOLE for p in "kv"},  # one kv head: both ranks take it
}


def _selected(config) -> tuple[str, ...]:
    return tuple(ARCHS) if "matrix" in (config.getoption("markexpr") or "") else SUITE


def pytest_generate_tests(metafunc):
    if "arch" in metafunc.fixturenames:
        metafunc.parametrize("arch", _selected(metafunc.config))


@pytest.fixture(scope="module")
def hf_tp(request, tmp_path_factory):
    """{arch: (checkpoint dir, [each rank's {disk name: part}], {disk name: transformers' style})} of the selected
    architectures, loaded by transformers under torchrun (one run for all of them)."""
    from safetensors.torch import load_file

    root, out = tmp_path_factory.mktemp("declared"), tmp_path_factory.mktemp("hf_tp")
    dirs = {a: write_checkpoint(a, str(root), ARCHS[a]) for a in _selected(request.config)}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={TP}",
                           os.path.join(REPO, "tests", "support", "hf_tp_worker.py"), "--out", str(out), *dirs.values()],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    result = {}
    for arch, d in dirs.items():
        with open(out / arch / "styles.json") as f:
            styles = json.load(f)
        result[arch] = (d, [load_file(out / arch / f"rank{r}.safetensors") for r in range(TP)], styles)
    return result


def _engine(arch: str, name: str):
    return next((ref for (a, end), ref in ENGINE.items() if a == arch and name.endswith(end)), None)


@pytest.mark.matrix
def test_shards_equal_transformers_tp_loading(hf_tp, arch):
    d, parts, styles = hf_tp[arch]
    assert "error" not in styles, f"transformers could not load {arch} at tp={TP}: {styles['error']}"
    plan = raylazy.plan(d, TP)
    full, files = reference_tensors(d), read_files(plan)
    assert plan.skipped == () and all(sorted(t.name for t in rp.tensors) == sorted(full) for rp in plan.ranks)
    compared = 0
    for rank, rp in enumerate(plan.ranks):
        for shard in rp.tensors:
            theirs = parts[rank][shard.name]
            engine = _engine(arch, shard.name)
            expected = theirs if engine is None else engine(full[shard.name], rank)
            if engine is not None:  # the override is needed: transformers holds something else there
                assert not (theirs.shape == expected.shape and torch.equal(theirs, expected)), shard.name
            assert apply_reads(shard, files) == as_bytes(expected), \
                f"{arch} rank {rank}: {shard.name} ({shard.placement}; transformers' style {styles.get(shard.name)})"
            compared += 1
    assert compared == TP * len(full)


def test_engine_overrides_name_real_tensors(hf_tp):
    """Every ENGINE entry of a selected architecture names tensors its checkpoint has (none is stale)."""
    for (arch, end) in ENGINE:
        if arch in hf_tp:
            assert any(n.endswith(end) for n in hf_tp[arch][1][0]), (arch, end)


def test_table_matches_the_installed_transformers():
    """The shipped table equals what the installed transformers declares, for the model types both know, and
    lacks none of them (`tools/declared_plans.py --check`, run as a developer runs it); a mismatch means
    transformers changed: regenerate the table (its command is in the output)."""
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(TOOLS / "declared_plans.py"), "--check"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"transformers {transformers_version()}: " in done.stderr and "the table agrees" in done.stderr


def test_model_types_planned():
    """Every preset and every model type transformers declares a plan for can be planned; one nothing covers is an
    error naming its tensors and the fixes."""
    assert {"llama", "gemma2", "phi3", "gpt_neox", "gpt_oss", "deepseek_v3", "olmoe", "starcoder2"} <= planned_types()
    assert len(planned_types()) >= 100


def test_unknown_model_type_names_its_tensors_and_the_fix(tmp_path):
    from safetensors.torch import save_file

    save_file({"blocks.0.attn.wqkv": torch.zeros(4, 4), "head": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_arch"}))
    with pytest.raises(UnknownArchitectureError) as e:
        raylazy.plan(str(tmp_path), 2)
    msg = str(e.value)
    assert all(s in msg for s in ("my_arch", "'blocks.0.attn.wqkv'", "'head'", "--rules FILE", "rules=[", "preset="))


@pytest.mark.parametrize("names", [["model.layers.3.mlp.w1.weight", "model.layers.13.mlp.w1.weight",
                                    "model.layers.61.self_attn.q_proj.weight", "model.layers.6.self_attn.q_proj.weight",
                                    "lm_head.weight", "x.12", "x.1", "model.layers.1.mlp.experts.0.w2.weight"]])
def test_matching_gives_the_first_matching_rule(names):
    """The matcher (rules joined into one alternation, answers shared by names that differ in their indices) gives
    what trying each rule in turn gives, for rules of every kind: globs with and without digits, regexes of whole
    segments, other regexes, inline flags."""
    r = Replicated()
    rules = (Rule("*layers.61.*", r), Rule(r"model\.layers\.\d+\.mlp\.w1\.weight", r, regex=True),
             Rule("*.self_attn.q_proj.weight", r), Rule(r"x\.1\d", r, regex=True), Rule("(?i)LM_HEAD.*", r, regex=True),
             Rule(r"(model)\.layers\.1\..*", r, regex=True), Rule("*.w?.weight", r), Rule("x.*", r))
    for subset in (rules, rules[1:3], rules[2:], rules[6:]):
        expected = [next((i for i, rule in enumerate(subset) if rule.matches(name)), None) for name in names]
        assert _first_match(subset)(names) == expected, [x.pattern for x in subset]


def test_the_docs_table_lists_every_model_type_planned():
    """docs/rules.md's table: every model type raylazy plans, where its rules come from, and its oracles."""
    import re

    from raylazy.core.declared import declared_types
    from raylazy.core.rules import PRESETS
    from tests.integrations import test_declared_vllm

    with open(os.path.join(REPO, "docs", "rules.md"), encoding="utf-8") as f:
        rows = {t: (source, oracles) for t, source, oracles in
                re.findall(r"^\| `([\w-]+)` \| (declared|preset|both) \| (.*) \|$", f.read(), flags=re.M)}
    assert set(rows) == planned_types()
    tested = {model_type for model_type, _ in ARCHS.values()}
    for t, (source, oracles) in rows.items():
        assert source == ("both" if t in PRESETS and t in declared_types() else "preset" if t in PRESETS else "declared"), t
        assert ("transformers TP" in oracles) == (t in tested), t
        assert ("vLLM" in oracles) == (t in test_declared_vllm.ARCHS), t
