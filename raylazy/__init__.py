"""raylazy: load safetensors checkpoints for tensor-parallel inference on Ray, reading only what each rank needs.

The layers import one way: the pure core (headers, rules, plans) knows nothing of
I/O or Ray; the readers (`raylazy.io`) execute one rank's plan without Ray; the
Ray layer (`raylazy.loader`, `raylazy.actor`, `raylazy.placement`) places and
drives one actor per rank.
"""

from .actor import RankMixin
from .checkpoint import Checkpoint, ModelConfig, open_checkpoint
from .errors import RaylazyError, RankFailedError
from .group import RankGroup
from .header import FileHeader, TensorInfo, read_header
from .io.backends import read_rank
from .loader import LoadedModel, load
from .mesh import Mesh
from .placements import Expert, Fused, Heads, Placement, Replicated, Skip, Split
from .plans import Plan, RankPlan, Read, TensorShard, format_bytes
from .planner import make_plan as plan
from .rules import PRESETS, Rule, read_rules

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "Expert", "FileHeader", "Fused", "Heads", "LoadedModel", "Mesh", "ModelConfig", "PRESETS", "Placement",
    "Plan", "RankFailedError", "RankGroup", "RankMixin", "RankPlan", "RaylazyError", "Read", "Replicated", "Rule", "Skip",
    "Split", "TensorInfo", "TensorShard", "format_bytes", "load", "open_checkpoint", "plan", "read_header", "read_rank",
    "read_rules",
]
