"""Rules map tensor names to placements; presets hold the rules of known architectures.

A rule is a pattern (a glob by default, a regular expression with `regex=True`)
and a placement. The first rule that matches a name wins. User rules go before
the preset chosen from config.json's `model_type`, so they override it. A rule may
also name the pipeline stage of tensors without a layer index (`raylazy.core.stages`):
the first matching rule that names one decides.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

from ..errors import RuleError, RuleFileError, UnknownArchitectureError, UnmatchedTensorError
from .placements import Expert, Fused, Heads, Placement, Replicated, Skip, Split, placement_from_dict
from .stages import Stage


@dataclass(frozen=True)
class Rule:
    """Tensors whose name matches `pattern` get `placement`; those without a layer index go to `stage`
    ("first", "last", "all" or "embedding", see `raylazy.core.stages`) when the mesh has pipeline stages."""

    pattern: str
    placement: Placement
    regex: bool = False
    stage: Stage | None = None

    def __post_init__(self):
        if self.stage is not None and self.stage not in get_args(Stage):
            raise RuleError(f"rule {self.pattern!r}: stage {self.stage!r} is not one of {', '.join(get_args(Stage))}")
        try:
            object.__setattr__(self, "_re", re.compile(self.pattern if self.regex else fnmatch.translate(self.pattern)))
        except re.error as e:
            raise RuleError(f"rule pattern {self.pattern!r} is not a valid regular expression: {e}") from None

    def matches(self, name: str) -> bool:
        return self._re.fullmatch(name) is not None

    def __reduce__(self):  # the compiled pattern is derived; rebuild it after pickling
        return (Rule, (self.pattern, self.placement, self.regex, self.stage))


RulesLike = Sequence[Rule | tuple] | Mapping[str, Placement]

COLUMN, ROW = Split(0), Split(-1)

_LLAMA = (
    Rule("*.self_attn.q_proj.*", Heads("q")),
    Rule("*.self_attn.k_proj.*", Heads("kv")),
    Rule("*.self_attn.v_proj.*", Heads("kv")),
    Rule("*.self_attn.qkv_proj.*", Fused((Heads("q"), Heads("kv"), Heads("kv")))),
    Rule("*.self_attn.o_proj.weight", ROW),
    Rule("*.mlp.gate_up_proj.weight", Fused((COLUMN, COLUMN))),
    Rule("*.mlp.gate_proj.*", COLUMN),
    Rule("*.mlp.up_proj.*", COLUMN),
    Rule("*.mlp.down_proj.weight", ROW),
    Rule("*.bias", Replicated()),  # row-parallel biases (o_proj, down_proj) are added once, after the reduce
    Rule("model.norm.weight", Replicated(), stage="last"),  # the final norm
    Rule("*norm.weight", Replicated()),
    Rule("*.rotary_emb.inv_freq", Skip()),
    Rule("model.embed_tokens.weight", COLUMN, stage="embedding"),  # vocab-parallel
    Rule("lm_head.weight", COLUMN, stage="last"),
)

#: Routed experts: tp-sharded like an MLP, or with expert parallel whole experts to one rank each.
#: transformers 5 holds them fused in memory (and checkpoints saved from its state_dict have them so on disk):
#: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I].
_FUSED_EXPERTS = (
    Rule("*.experts.gate_up_proj", Expert(Fused((Split(1), Split(1)), dim=1), dim=0)),
    Rule("*.experts.down_proj", Expert(Split(-1), dim=0)),
    Rule("*.mlp.gate.weight", Replicated()),  # the router
)

_MIXTRAL = (
    Rule("*.block_sparse_moe.gate.weight", Replicated()),
    Rule("*.block_sparse_moe.experts.*.w1.weight", Expert(COLUMN)),
    Rule("*.block_sparse_moe.experts.*.w3.weight", Expert(COLUMN)),
    Rule("*.block_sparse_moe.experts.*.w2.weight", Expert(ROW)),
) + _FUSED_EXPERTS + _LLAMA

#: Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 name routed experts `mlp.experts.<e>.{gate,up,down}_proj`; shared
#: experts and dense layers are tp-sharded MLPs (as vLLM shards them). The routed experts' rules come first:
#: they match most tensors of these models.
_ROUTED = (
    Rule("*.mlp.experts.*.gate_proj.weight", Expert(COLUMN)),
    Rule("*.mlp.experts.*.up_proj.weight", Expert(COLUMN)),
    Rule("*.mlp.experts.*.down_proj.weight", Expert(ROW)),
)

_QWEN_MOE = _ROUTED + (
    Rule("*.mlp.shared_expert.gate_proj.weight", COLUMN),
    Rule("*.mlp.shared_expert.up_proj.weight", COLUMN),
    Rule("*.mlp.shared_expert.down_proj.weight", ROW),
    Rule("*.mlp.shared_expert_gate.weight", Replicated()),
) + _FUSED_EXPERTS + _LLAMA

#: DeepSeek-V2/V3 multi-head latent attention: the low-rank down-projections are replicated, the up-projections
#: split by whole heads (q_b_proj: heads x qk_head_dim rows, kv_b_proj: heads x (qk_nope + v) rows), o_proj
#: row-parallel; the router's score correction bias is replicated. The released checkpoints' FP8 block scales
#: (`weight_scale_inv`) need no rules: they follow their weights (`raylazy.core.quantization`).
_DEEPSEEK = _ROUTED + (
    Rule("*.self_attn.q_a_proj.weight", Replicated()),
    Rule("*.self_attn.kv_a_proj_with_mqa.weight", Replicated()),
    Rule("*.self_attn.q_b_proj.weight", Heads("q")),
    Rule("*.self_attn.kv_b_proj.weight", Heads("q")),
    Rule("*.mlp.shared_experts.gate_proj.weight", COLUMN),
    Rule("*.mlp.shared_experts.up_proj.weight", COLUMN),
    Rule("*.mlp.shared_experts.down_proj.weight", ROW),
    Rule("*.mlp.gate.e_score_correction_bias", Replicated()),
    # The multi-token-prediction layer (DeepSeek-V3's layer 61, loaded with keep_mtp=True), as vLLM's DeepSeekMTP
    # holds it: eh_proj a plain nn.Linear (whole), its embeddings and head vocab-parallel, enorm/hnorm norms.
    Rule("*.eh_proj.weight", Replicated()),
    Rule("*.shared_head.head.weight", COLUMN),
    Rule("model.layers.*.embed_tokens.weight", COLUMN),
) + _FUSED_EXPERTS + _LLAMA

#: Rules of the on-disk tensor names of each supported `model_type`.
PRESETS: Mapping[str, tuple[Rule, ...]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": _MIXTRAL,
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": _QWEN_MOE,
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
}


def as_rules(rules: RulesLike | None) -> tuple[Rule, ...]:
    """Normalise rules given as Rule objects, (pattern, placement) pairs or a {pattern: placement} map."""
    if rules is None:
        return ()
    items = rules.items() if isinstance(rules, Mapping) else rules
    out = []
    for item in items:
        rule = item if isinstance(item, Rule) else Rule(*item)
        if not isinstance(rule.placement, Placement):
            raise RuleError(f"rule {rule.pattern!r}: {rule.placement!r} is not a placement (a raylazy.core.placements.Placement)")
        out.append(rule)
    return tuple(out)


def read_rules(path: str | os.PathLike) -> tuple[Rule, ...]:
    """Rules from a JSON file: a list of `{"pattern": ..., "placement": {"type": ...}, "regex": false}`.

    Placements are written as `Placement.to_dict` writes them, e.g. `{"type": "split", "dim": -1}`.
    Any problem is a RuleFileError naming the file and, for a bad entry, its index and pattern.
    """
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RuleFileError(f"rules file {os.fspath(path)}: cannot read it as JSON: {e}") from None
    if not isinstance(entries, list):
        raise RuleFileError(f"rules file {os.fspath(path)}: expected a JSON list of rules "
                            f'({{"pattern": ..., "placement": {{"type": ...}}}}), got a {type(entries).__name__}')
    return tuple(_rule_entry(path, i, entry) for i, entry in enumerate(entries))


def _rule_entry(path, i: int, entry) -> Rule:
    where = f"rules file {os.fspath(path)}, entry {i}"
    try:
        if not isinstance(entry, dict):
            raise RuleError(f'expected an object {{"pattern": ..., "placement": ...}}, got {entry!r}')
        where += f" ({entry.get('pattern')!r})"
        unknown = set(entry) - {"pattern", "placement", "regex", "stage"}
        if unknown or not {"pattern", "placement"} <= set(entry):
            raise RuleError(f'an entry has "pattern", "placement" and optionally "regex" and "stage", got keys {sorted(entry)}')
        pattern, regex = entry["pattern"], entry.get("regex", False)
        if not isinstance(pattern, str) or type(regex) is not bool:
            raise RuleError(f'"pattern" must be a string and "regex" true or false, got {pattern!r} and {regex!r}')
        return Rule(pattern, placement_from_dict(entry["placement"]), regex, entry.get("stage"))
    except RuleError as e:
        raise RuleFileError(f"{where}: {e}") from None


def resolve_rules(model_type: str | None, rules: RulesLike | None = None, preset: str | None = "auto") -> tuple[Rule, ...]:
    """User rules followed by the preset (`"auto"`: the one for `model_type`; None: no preset)."""
    user = as_rules(rules)
    name = model_type if preset == "auto" else preset
    if name in PRESETS:
        return user + PRESETS[name]
    if user and preset in ("auto", None):
        return user
    raise UnknownArchitectureError(
        f"no sharding preset for model_type {name!r} (presets: {', '.join(sorted(PRESETS))}); pass your own "
        "rules, e.g. rules=[('*.q_proj.weight', Heads('q')), ('*.o_proj.weight', Split(-1)), "
        "('*norm.weight', Replicated())], or preset='llama' if its tensor names match"
    )


def match(rules: Iterable[Rule], names: Iterable[str]) -> dict[str, Rule]:
    """The first matching rule of every name; unmatched names are an error listing them."""
    rules = tuple(rules)
    found, unmatched = {}, []
    for name in names:
        rule = next((r for r in rules if r.matches(name)), None)
        if rule is None:
            unmatched.append(name)
        else:
            found[name] = rule
    if unmatched:
        shown = ", ".join(repr(n) for n in unmatched[:10])
        more = f" and {len(unmatched) - 10} more" if len(unmatched) > 10 else ""
        raise UnmatchedTensorError(
            f"{len(unmatched)} tensor(s) match no sharding rule: {shown}{more}; add rules for them "
            "(Replicated() to load whole on every rank, Skip() to leave them out)"
        )
    return found


def stage_of(rules: Iterable[Rule], name: str) -> Stage | None:
    """The stage the first matching rule that names one gives `name` (None: no rule does)."""
    return next((r.stage for r in rules if r.stage is not None and r.matches(name)), None)
