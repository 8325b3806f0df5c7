"""raylazy: load safetensors checkpoints for tensor-parallel inference on Ray, reading only what each rank needs.

The layers import one way, and `lint-imports` (pyproject.toml) checks it: the pure core (`raylazy.core`:
headers, rules, plans) reads nothing and knows no Ray; storage (`raylazy.storage`) opens and reads checkpoint
bytes; the readers (`raylazy.io`) execute one rank's plan without Ray; the Ray layer (`raylazy.cluster`) places
and drives one actor per rank; integrations (`raylazy.integrations`, vLLM) sit beside it, on the core, storage
and readers. Importing this package imports no Ray: its modules import Ray where they use it.
"""

from .cluster.actor import RankMixin
from .cluster.group import RankGroup
from .cluster.loader import LoadedModel, load
from .core.checkpoint import Checkpoint, ModelConfig
from .core.estimate import Estimate, estimate
from .core.hardware import Hardware
from .core.header import FileHeader, TensorInfo
from .core.mesh import Mesh
from .core.placements import Expert, Fused, Heads, Placement, Replicated, Skip, Split
from .core.plans import Plan, RankPlan, Read, TensorShard, format_bytes
from .core.rules import PRESETS, Rule, read_rules
from .errors import RankFailedError, RaylazyError
from .io.backends import read_rank
from .planning import make_plan as plan
from .storage import open_checkpoint, read_header

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "Estimate", "Expert", "FileHeader", "Fused", "Hardware", "Heads", "LoadedModel", "Mesh", "ModelConfig", "PRESETS", "Placement",
    "Plan", "RankFailedError", "RankGroup", "RankMixin", "RankPlan", "RaylazyError", "Read", "Replicated", "Rule", "Skip",
    "Split", "TensorInfo", "TensorShard", "estimate", "format_bytes", "load", "open_checkpoint", "plan", "read_header", "read_rank",
    "read_rules",
]
