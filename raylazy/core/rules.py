"""Rules map tensor names to placements; presets hold what the declared plans of known architectures do not say.

A rule is a pattern (a glob by default, a regular expression with `regex=True`)
and a placement. The first rule that matches a name wins. User rules go first, then
the built-in rules of config.json's `model_type`: its preset, then the rules of the
tensor-parallel plan transformers declares for it (`raylazy.core.declared`). A rule may
also name the pipeline stage of tensors without a layer index (`raylazy.core.stages`):
the first matching rule that names one decides.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

from ..errors import RuleError, RuleFileError, UnknownArchitectureError, UnmatchedTensorError
from .declared import declared_rules, declared_types
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

# Presets hold only what transformers' declared plan of a model type does not say (raylazy.core.declared has the rest).
# Their patterns name a layer's weight and bias, never `layer.*`: a quantized checkpoint's companions of a weight
# (`weight_scale_inv`, ...) are sharded at their own granularity, not as the weight.


def _weight_and_bias(layer: str, placement: Placement) -> tuple[Rule, Rule]:
    return Rule(f"{layer}.weight", placement), Rule(f"{layer}.bias", placement)


#: Llama-family checkpoints converted from other layouts hold fused q|k|v and gate|up projections, and older
#: exports a stale rotary buffer: none of them is a parameter of transformers' model.
_LLAMA = (
    *_weight_and_bias("*.self_attn.qkv_proj", Fused((Heads("q"), Heads("kv"), Heads("kv")))),
    Rule("*.mlp.gate_up_proj.weight", Fused((COLUMN, COLUMN))),
    Rule("*.rotary_emb.inv_freq", Skip()),
)

#: Qwen2-MoE's shared expert: transformers leaves it replicated, engines shard it as an MLP (vLLM does).
_QWEN2_MOE = (
    Rule("*.mlp.shared_expert.gate_proj.weight", COLUMN),
    Rule("*.mlp.shared_expert.up_proj.weight", COLUMN),
    Rule("*.mlp.shared_expert.down_proj.weight", ROW),
) + _LLAMA

#: The multi-token-prediction layer after the last (DeepSeek-V3's layer 61, planned with keep_mtp=True; transformers'
#: model has none, so no declared plan names it), as vLLM's DeepSeekMTP holds it: eh_proj a plain nn.Linear (whole),
#: its norms replicated, its embeddings and head vocab-parallel; its decoder layer is the other layers' kind.
_MTP = (
    Rule("*.eh_proj.weight", Replicated()),
    Rule("*.enorm.weight", Replicated()),
    Rule("*.hnorm.weight", Replicated()),
    Rule("*.shared_head.norm.weight", Replicated()),
    Rule("*.shared_head.head.weight", COLUMN),
    Rule("model.layers.*.embed_tokens.weight", COLUMN),
)

#: DeepSeek-V3's multi-head latent attention, which its declared plan leaves out: the low-rank down-projections stay
#: replicated (the plan's default), the up-projections are split by whole heads (q_b_proj: heads x qk_head_dim
#: rows, kv_b_proj: heads x (qk_nope + v) rows), o_proj is row-parallel.
_DEEPSEEK_V3 = (
    Rule("*.self_attn.q_proj.weight", Heads("q")),
    Rule("*.self_attn.q_b_proj.weight", Heads("q")),
    Rule("*.self_attn.kv_b_proj.weight", Heads("q")),
    Rule("*.self_attn.o_proj.weight", ROW),
    *_MTP,
) + _LLAMA

#: gpt-oss declares only its embeddings. Attention as an engine shards it, each head's sink with its head; the
#: experts lie [E, H, 2I] with gate and up interleaved along 2I, so a contiguous split takes whole (gate, up)
#: pairs (as vLLM splits them); down_proj [E, I, H] splits I; its bias is added once, after the reduce.
_GPT_OSS = (
    *_weight_and_bias("*.self_attn.q_proj", Heads("q")),
    *_weight_and_bias("*.self_attn.k_proj", Heads("kv")),
    *_weight_and_bias("*.self_attn.v_proj", Heads("kv")),
    Rule("*.self_attn.o_proj.weight", ROW),
    Rule("*.self_attn.sinks", Heads("q")),
    Rule("*.mlp.experts.gate_up_proj", Expert(ROW, dim=0)),
    Rule("*.mlp.experts.gate_up_proj_bias", Expert(ROW, dim=0)),
    Rule("*.mlp.experts.down_proj", Expert(Split(1), dim=0)),
    Rule("*.mlp.experts.down_proj_bias", Expert(Replicated(), dim=0)),
)

#: Rules of the on-disk tensor names of a `model_type`, before its declared plan's (`raylazy.core.declared`).
PRESETS: Mapping[str, tuple[Rule, ...]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": _LLAMA,
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _LLAMA,
    "deepseek_v2": _LLAMA,
    "deepseek_v3": _DEEPSEEK_V3,
    "gpt_oss": _GPT_OSS,
}


def planned_types() -> frozenset[str]:
    """Every model type raylazy has rules for: a preset, a declared plan, or both."""
    return frozenset(PRESETS) | declared_types()


@functools.cache
def builtin_rules(model_type: str | None) -> tuple[Rule, ...]:
    """The preset of `model_type`, then the rules of its declared plan (none for a model type raylazy does not know)."""
    declared = tuple(Rule(r.regex, r.placement, regex=True, stage=r.stage) for r in declared_rules(model_type))
    return PRESETS.get(model_type, ()) + declared


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
    """User rules, then the built-in rules (`builtin_rules`) of `preset`: `"auto"`, those of `model_type`; another
    name, those of that model type; None, none. For a model type raylazy does not know, the user rules alone (`match`
    names what they leave unmatched); a preset raylazy does not know is an UnknownArchitectureError."""
    user = as_rules(rules)
    name = model_type if preset == "auto" else preset
    builtin = builtin_rules(name) if name is not None else ()
    if not builtin and preset not in ("auto", None):
        raise UnknownArchitectureError(
            f"preset={preset!r} names no model type raylazy has rules for ({len(planned_types())} model types: a "
            f"preset for {', '.join(sorted(PRESETS))}, and those transformers declares a tensor-parallel plan for; "
            "docs/rules.md lists them)")
    return user + builtin


def match(rules: Iterable[Rule], names: Iterable[str], model_type: str | None = None) -> dict[str, Rule]:
    """The first matching rule of every name; unmatched names are an error listing them (an UnknownArchitectureError
    when there are no rules at all: `model_type` has no preset and no declared plan, and none were given)."""
    rules, names = tuple(rules), list(names)
    found, unmatched = {}, []
    for name, i in zip(names, _first_match(rules)(names)):
        if i is None:
            unmatched.append(name)
        else:
            found[name] = rules[i]
    if unmatched:
        shown = ", ".join(repr(n) for n in unmatched[:10])
        more = f" and {len(unmatched) - 10} more" if len(unmatched) > 10 else ""
        fix = ("give rules for them: rules=[('*.my_proj.weight', Split(-1)), ...] (Replicated() to load whole on every "
               "rank, Skip() to leave them out), or `--rules FILE` on the command line (docs/rules.md)")
        if not rules:
            raise UnknownArchitectureError(
                f"no sharding rules for model_type {model_type!r}: raylazy has no preset for it and transformers "
                f"declares no tensor-parallel plan for it, so its {len(unmatched)} tensor(s) match no rule: {shown}"
                f"{more}; {fix}, or preset='llama' if its tensor names are Llama's")
        raise UnmatchedTensorError(f"{len(unmatched)} tensor(s) match no sharding rule: {shown}{more}; {fix}")
    return found


#: An index segment of a tensor name (`layers.12.`): all digits, between dots or the name's ends.
_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")
#: The same in names each after a "." and before a "\n" (`_skeletons`): a dot, then digits up to a dot or newline.
_DOT_INDEX = re.compile(r"\.\d+(?=[.\n])")
#: A segment of a regular expression rule that matches by segments: an index, or a literal that is not all digits.
_SEGMENT = re.compile(r"\\d\+|\w*[^\W\d]\w*")


def _index_blind(rule: Rule) -> bool:
    """Whether the rule matches a name or not whatever its index segments hold: a glob without digits, `?` or `[`,
    or a regular expression of whole segments between escaped dots, each a literal or `\\d+` (declared plans')."""
    if not rule.regex:
        return re.fullmatch(r"[^0-9?[\]]*", rule.pattern) is not None
    return all(_SEGMENT.fullmatch(p) for p in rule.pattern.split(r"\."))


@functools.lru_cache(maxsize=32)
def _first_match(rules: tuple[Rule, ...]):
    """A function: names -> the index of the first of `rules` that matches each, or None (an index: equal rule
    tuples share the cache). Planning matches 10^5 names of a few dozen kinds: when every rule is `_index_blind`,
    names that differ only in their indices share one answer; consecutive groupless rules are tried as one
    alternation."""
    runs: list[list[int]] = []
    for i, rule in enumerate(rules):
        if rule._re.groups == 0 and runs and rules[runs[-1][-1]]._re.groups == 0:
            runs[-1].append(i)
        else:
            runs.append([i])
    tries = [t for run in runs for t in _joined(rules, run)]

    def scan(name: str) -> int | None:
        for pattern, run in tries:
            if (m := pattern.fullmatch(name)) is not None:
                return run[m.lastindex - 1] if m.lastindex else run[0]
        return None

    if not all(map(_index_blind, rules)):
        return lambda names: list(map(scan, names))
    answers: dict[str, int | None] = {}

    def first(names: list[str]) -> list[int | None]:
        out = []
        for name, key in zip(names, _skeletons(names)):
            if key not in answers:
                answers[key] = scan(name)
            out.append(answers[key])
        return out

    return first


def _skeletons(names: list[str]) -> list[str]:
    """Each name with its index segments as `*` (`_INDEX`): one pass of a regular expression over all the names
    joined, each after a "." and before a newline, unless a name holds a newline itself."""
    joined = "." + "\n.".join(names) + "\n"
    if joined.count("\n") != len(names):
        return [_INDEX.sub("*", n) for n in names]
    return _DOT_INDEX.sub(".*", joined)[1:-1].split("\n.")


def _joined(rules: tuple[Rule, ...], run: list[int]) -> list[tuple[re.Pattern, list[int]]]:
    """(pattern, rule indices): a run's patterns as one alternation, a group a rule, or each rule alone."""
    if len(run) > 1:
        try:
            return [(re.compile("|".join(f"({rules[i]._re.pattern})" for i in run)), run)]
        except re.error:  # inline flags are valid only at the start of a pattern: try such rules one by one
            pass
    return [(rules[i]._re, [i]) for i in run]


def stage_of(rules: Iterable[Rule], name: str) -> Stage | None:
    """The stage the first matching rule that names one gives `name` (None: no rule does)."""
    return next((r.stage for r in rules if r.stage is not None and r.matches(name)), None)
