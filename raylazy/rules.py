"""Rules map tensor names to placements; presets hold the rules of known architectures.

A rule is a pattern (a glob by default, a regular expression with `regex=True`)
and a placement. The first rule that matches a name wins. User rules go before
the preset chosen from config.json's `model_type`, so they override it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Union

from .errors import RuleError, RuleFileError, UnknownArchitectureError, UnmatchedTensorError
from .placements import Fused, Heads, Placement, Replicated, Skip, Split, placement_from_dict


@dataclass(frozen=True)
class Rule:
    """Tensors whose name matches `pattern` get `placement`."""

    pattern: str
    placement: Placement
    regex: bool = False

    def __post_init__(self):
        try:
            object.__setattr__(self, "_re", re.compile(self.pattern if self.regex else fnmatch.translate(self.pattern)))
        except re.error as e:
            raise RuleError(f"rule pattern {self.pattern!r} is not a valid regular expression: {e}") from None

    def matches(self, name: str) -> bool:
        return self._re.fullmatch(name) is not None

    def __reduce__(self):  # the compiled pattern is derived; rebuild it after pickling
        return (Rule, (self.pattern, self.placement, self.regex))


RulesLike = Union[Sequence[Union[Rule, tuple]], Mapping[str, Placement]]

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
    Rule("*norm.weight", Replicated()),
    Rule("*.rotary_emb.inv_freq", Skip()),
    Rule("model.embed_tokens.weight", COLUMN),  # vocab-parallel
    Rule("lm_head.weight", COLUMN),
)

_MIXTRAL_EXPERTS = (
    Rule("*.block_sparse_moe.gate.weight", Replicated()),
    Rule("*.block_sparse_moe.experts.*.w1.weight", COLUMN),
    Rule("*.block_sparse_moe.experts.*.w3.weight", COLUMN),
    Rule("*.block_sparse_moe.experts.*.w2.weight", ROW),
    Rule("*.mlp.gate.weight", Replicated()),
    # transformers 5 writes experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    Rule("*.mlp.experts.gate_up_proj", Fused((Split(1), Split(1)), dim=1)),
    Rule("*.mlp.experts.down_proj", Split(-1)),
)

#: Rules of the on-disk tensor names of each supported `model_type`.
PRESETS: Mapping[str, tuple[Rule, ...]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": _MIXTRAL_EXPERTS + _LLAMA,
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
            raise RuleError(f"rule {rule.pattern!r}: {rule.placement!r} is not a placement (a raylazy.placements.Placement)")
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
        unknown = set(entry) - {"pattern", "placement", "regex"}
        if unknown or not {"pattern", "placement"} <= set(entry):
            raise RuleError(f'an entry has "pattern", "placement" and optionally "regex", got keys {sorted(entry)}')
        pattern, regex = entry["pattern"], entry.get("regex", False)
        if not isinstance(pattern, str) or type(regex) is not bool:
            raise RuleError(f'"pattern" must be a string and "regex" true or false, got {pattern!r} and {regex!r}')
        return Rule(pattern, placement_from_dict(entry["placement"]), regex)
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
