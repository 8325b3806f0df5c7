"""raylazy: load safetensors checkpoints for tensor-parallel inference on Ray, reading only what each rank needs.

The layers import one way: the pure core (headers, rules, plans) knows nothing of
I/O or Ray; the readers (`raylazy.io`) execute one rank's plan without Ray; the
Ray layer (`raylazy.loader`, `raylazy.actor`, `raylazy.placement`) places and
drives one actor per rank.
"""

from .checkpoint import Checkpoint, ModelConfig, open_checkpoint
from .errors import RaylazyError, RankFailedError
from .header import FileHeader, TensorInfo, read_header
from .mesh import Mesh
from .placements import Fused, Heads, Placement, Replicated, Skip, Split
from .plans import Plan, RankPlan, Read, TensorShard
from .planner import make_plan as plan
from .rules import PRESETS, Rule, read_rules

__version__ = "0.1.0"


def load(model_dir, tp: int = 8, **kwargs):
    """Load `model_dir` with tensor parallelism `tp` on Ray; see `raylazy.loader.load`."""
    from .loader import load as _load

    return _load(model_dir, tp, **kwargs)


__all__ = [
    "Checkpoint", "FileHeader", "Fused", "Heads", "Mesh", "ModelConfig", "PRESETS", "Placement", "Plan",
    "RankFailedError", "RankPlan", "RaylazyError", "Read", "Replicated", "Rule", "Skip", "Split", "TensorInfo",
    "TensorShard", "load", "open_checkpoint", "plan", "read_header", "read_rules",
]
