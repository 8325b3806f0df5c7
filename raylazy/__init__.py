"""raylazy: load safetensors checkpoints for tensor-parallel inference on Ray, reading only what each rank needs.

The layers import one way, and `lint-imports` (pyproject.toml) checks it: the pure core (`raylazy.core`:
headers, rules, plans) reads nothing and knows no Ray; storage (`raylazy.storage`) opens and reads checkpoint
bytes; the readers (`raylazy.io`) execute one rank's plan without Ray; the Ray layer (`raylazy.cluster`) places
and drives one actor per rank; integrations (`raylazy.integrations`, vLLM) sit beside it, on the core, storage
and readers. Importing this package imports no Ray: its modules import Ray where they use it.
"""

import importlib

#: The public names, each imported from its module on first use (`__getattr__`), so that importing one part of the
#: package (the vLLM plugin, which every vLLM process imports; the readers in a rank's process) imports no other.
_EXPORTS = {
    "Checkpoint": ("core.checkpoint", "Checkpoint"),
    "Estimate": ("core.estimate", "Estimate"),
    "estimate": ("core.estimate", "estimate"),
    "Expert": ("core.placements", "Expert"),
    "FileHeader": ("core.header", "FileHeader"),
    "format_bytes": ("core.plans", "format_bytes"),
    "Fused": ("core.placements", "Fused"),
    "Hardware": ("core.hardware", "Hardware"),
    "HeldModel": ("cluster.holder", "HeldModel"),
    "hold": ("cluster.holder", "hold"),
    "holders": ("cluster.holder", "holders"),
    "Heads": ("core.placements", "Heads"),
    "load": ("cluster.loader", "load"),
    "LoadedModel": ("cluster.loader", "LoadedModel"),
    "Mesh": ("core.mesh", "Mesh"),
    "ModelConfig": ("core.checkpoint", "ModelConfig"),
    "open_checkpoint": ("storage", "open_checkpoint"),
    "Placement": ("core.placements", "Placement"),
    "Plan": ("core.plans", "Plan"),
    "plan": ("planning", "make_plan"),
    "PRESETS": ("core.rules", "PRESETS"),
    "RankFailedError": ("errors", "RankFailedError"),
    "RankGroup": ("cluster.group", "RankGroup"),
    "RankMixin": ("cluster.actor", "RankMixin"),
    "RankPlan": ("core.plans", "RankPlan"),
    "RaylazyError": ("errors", "RaylazyError"),
    "Read": ("core.plans", "Read"),
    "read_header": ("storage", "read_header"),
    "read_rank": ("io.backends", "read_rank"),
    "read_rules": ("core.rules", "read_rules"),
    "Replicated": ("core.placements", "Replicated"),
    "Rule": ("core.rules", "Rule"),
    "Skip": ("core.placements", "Skip"),
    "Split": ("core.placements", "Split"),
    "TensorInfo": ("core.header", "TensorInfo"),
    "TensorShard": ("core.plans", "TensorShard"),
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'raylazy' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)
