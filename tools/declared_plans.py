"""Reads the tensor-parallel plans transformers declares into raylazy's table of them (`raylazy/core/declared_plans.json`).

For every model type whose config declares a `base_model_tp_plan` and that has a causal-LM class, the model is
built on the meta device (no memory, no weights) and each tensor of its state dict is recorded with the style the
model's plan gives it (`base_model_tp_plan`, the class's `_tp_plan` for the head, the embeddings transformers adds
itself), under the names it has on disk: transformers' own reverse weight conversion (what `save_pretrained`
writes) names them, so fused experts appear as the per-expert tensors checkpoints hold and `lm_head` as
`embed_out` where that is the disk name; the in-memory names are recorded too (checkpoints saved from a state
dict have those). Each entry is `[pattern, style, layout, where]`:

- `pattern`: the name with every module-list index as `*` (`model.layers.*.mlp.experts.*.w1.weight`);
- `style`: transformers' style (`colwise`, `rowwise`, `packed_colwise`, ...), or null where the plan says nothing;
- `layout`: how the tensor lies relative to the parameter the style is declared for: `""` (it is that parameter),
  `"experts"` (a 3-d parameter of all experts, the expert dim first), `"expert"` (one expert's slice of it, on
  disk as a tensor of its own), `"expert i/k"` or `"part i/k"` (part i of the k that transformers concatenates
  into the parameter when loading), `"joined"` (a tensor transformers splits into several parameters);
- `where`: for a tensor outside the decoder layers, `"embedding"` (the input embeddings), `"head"` (the output
  embeddings), `"first"` or `"last"` (before or after the layers); null inside them.

raylazy maps these onto its placements at plan time (`raylazy.core.declared`) without importing transformers (an
import of several seconds, and transformers is not a dependency of raylazy). A development tool, not part of the
package; with `--check` (tests/core/test_declared.py runs it) it exits 1 where the table differs from what the installed
transformers declares. Regenerate after a transformers upgrade, then run tests/core/test_declared.py:

    python tools/declared_plans.py --write
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings

#: The table raylazy ships (raylazy/core/declared_plans.json).
TABLE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "raylazy", "core",
                          "declared_plans.json")
#: Sizes tried when a model type's default config cannot be built (a few need them to construct at all).
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_hidden_layers=2, vocab_size=256, rope_theta=10000.0, moe_intermediate_size=32)
_INDEX = re.compile(r"\.\d+(\.|$)")
#: Styles of linear layers: a module of one of these has a weight and may have a bias.
_LINEAR = {"colwise", "colwise_gather_output", "colwise_rep", "rowwise", "rowwise_split_input", "rowwise_rep",
           "packed_colwise", "packed_rowwise"}


def declared_plans() -> dict:
    """{"transformers": version, "plans": {model_type: [entry, ...]}, "left_out": {model_type: why}} from the
    installed transformers."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()
    plans, left_out = {}, {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        if not getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None):
            continue
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            left_out[model_type] = "no causal-LM class (a part of a multimodal model)"
            continue
        try:
            plans[model_type] = model_entries(_meta_model(model_type))
        except Exception as e:  # noqa: BLE001  (any failure to build one model type leaves it out, saying why)
            left_out[model_type] = f"cannot be built from its config: {type(e).__name__}: {str(e)[:120]}"
    return {"transformers": transformers.__version__, "plans": plans, "left_out": left_out}


def _meta_model(model_type: str):
    """The causal-LM model of `model_type` on the meta device: its default config, else one of SMALL sizes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
        except Exception:  # noqa: BLE001  (retried with small sizes; a second failure is the caller's)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL))


def model_entries(model) -> list[list]:
    """The table's entries of one model (built on the meta device): its state dict's tensors under their disk and
    in-memory names, then the weight and bias of every module the plan names that the config built without them
    (a bias off by default) or did not build (the dense layers of a MoE)."""
    from transformers.distributed.parallel_utils import _get_parameter_plan

    state = {}
    for name, tensor in model.state_dict().items():  # one tensor of each pattern: layers repeat
        state.setdefault(generic(name), (name, tensor))
    plan = model.tp_plan
    where = _where(model, list(state))
    entries: dict[str, list] = {}
    for pattern, (name, tensor) in state.items():
        style = _get_parameter_plan(name, plan)
        layout = "experts" if _is_experts(name, tensor) else ""
        for disk, disk_layout in [(pattern, layout)] + _disk_names(model, name, tensor, layout):
            entries.setdefault(disk, [disk, style, disk_layout, where.get(pattern)])
    for key, style in plan.items():
        if key in state or style not in _LINEAR:
            continue
        for pattern in ([key] if ".experts." in f".{key}" else []) + [key + ".weight", key + ".bias"]:
            layout = "experts" if pattern == key else ""
            entries.setdefault(pattern, [pattern, style, layout, where.get(key + ".weight")])
    return list(entries.values())


def generic(name: str) -> str:
    """`name` with every module-list index as `*` (transformers' own rule for plan keys)."""
    return _INDEX.sub(lambda m: ".*" + m.group(1), name)


def _is_experts(name: str, tensor) -> bool:
    return tensor.dim() == 3 and ".experts." in f".{name}"


def _disk_names(model, name: str, tensor, layout: str) -> list[tuple[str, str]]:
    """[(disk pattern, layout)] of in-memory tensor `name` (lying as `layout` says) where its disk names differ
    (none where they do not), from transformers' reverse conversion of that tensor alone: a renamed one lies as it
    does in memory, one expert's tensor is `expert`, a part of several `... i/k`; a disk tensor transformers
    splits into several in-memory ones is `joined`."""
    from transformers.core_model_loading import revert_weight_conversion

    patterns = list(dict.fromkeys(generic(n) for n in revert_weight_conversion(model, {name: tensor})))
    if patterns == [generic(name)]:
        return []
    if len(patterns) == 1 and _joins(model, patterns[0]):
        return [(patterns[0], "joined")]
    return [(p, _layout(p, i, len(patterns), layout)) for i, p in enumerate(patterns)]


def _joins(model, pattern: str) -> bool:
    """Whether a converter makes several in-memory tensors of the one disk tensor `pattern`."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    return any(isinstance(c, WeightConverter) and len(c.target_patterns) > 1 and
               any(re.search(p.replace("*", r"\d+"), pattern.replace("*", "0")) for p in c.source_patterns)
               for c in get_model_conversion_mapping(model, add_legacy=False))


def _layout(pattern: str, part: int, parts: int, layout: str) -> str:
    expert = ".experts.*." in f".{pattern}"
    if parts == 1:
        return "expert" if expert else layout
    return f"{'expert' if expert else 'part'} {part}/{parts}"


def _where(model, patterns: list[str]) -> dict[str, str]:
    """Where each tensor outside the module lists lies: the input or output embeddings, or before or after them."""
    modules = {id(m): n for n, m in model.named_modules()}
    roles = {}
    for role, module in (("embedding", model.get_input_embeddings()), ("head", model.get_output_embeddings())):
        if module is not None and id(module) in modules:
            roles[modules[id(module)]] = role
    out, seen_layers = {}, False
    for pattern in patterns:
        if "*" in pattern:
            seen_layers = True
            continue
        out[pattern] = roles.get(pattern.rsplit(".", 1)[0]) or ("last" if seen_layers else "first")
    return out


def write_table(table: dict, path: str = TABLE_PATH) -> None:
    """The table as JSON, one entry a line (diffs show what a transformers upgrade changed)."""
    lines = ["{", f'  "transformers": {json.dumps(table["transformers"])},', '  "plans": {']
    types = list(table["plans"])
    for i, model_type in enumerate(types):
        entries = table["plans"][model_type]
        lines.append(f"    {json.dumps(model_type)}: [")
        lines += [f"      {json.dumps(e)}{',' if j < len(entries) - 1 else ''}" for j, e in enumerate(entries)]
        lines.append("    ]" + ("," if i < len(types) - 1 else ""))
    lines += ["  },", f'  "left_out": {json.dumps(table["left_out"], indent=4, sort_keys=True)}'.replace("\n}", "\n  }"),
              "}", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def check(installed: dict, shipped: dict) -> list[str]:
    """What differs between the plans the installed transformers declares and the shipped table, for the model
    types both know, and the model types the table lacks (empty: they agree)."""
    both = installed["plans"].keys() & shipped["plans"].keys()
    problems = [f"only {len(both)} model types in both (expected at least 100)"] if len(both) < 100 else []
    differ = sorted(t for t in both if installed["plans"][t] != shipped["plans"][t])
    if differ:
        problems.append(f"transformers {installed['transformers']} declares other plans than the table (from "
                        f"{shipped['transformers']}) for {differ}")
    if lacking := sorted(installed["plans"].keys() - shipped["plans"].keys()):
        problems.append(f"model types the table lacks: {lacking}")
    if installed["transformers"] != shipped["transformers"]:
        problems.append(f"the table is from transformers {shipped['transformers']}, installed is "
                        f"{installed['transformers']}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"write the table to {TABLE_PATH}")
    what.add_argument("--check", action="store_true", help="exit 1 where the table differs from the installed "
                      "transformers")
    args = ap.parse_args(argv)
    table = declared_plans()
    if args.check:
        with open(TABLE_PATH, encoding="utf-8") as f:
            problems = check(table, json.load(f))
        for problem in problems:
            print(f"{problem}: run `python tools/declared_plans.py --write`, then tests/core/test_declared.py",
                  file=sys.stderr)
        if problems:
            return 1
    if args.write:
        write_table(table)
    print(f"transformers {table['transformers']}: {len(table['plans'])} model types, "
          f"{len(table['left_out'])} left out{'; the table agrees' if args.check else ''}", file=sys.stderr)
    for model_type, why in table["left_out"].items():
        print(f"  left out {model_type}: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
