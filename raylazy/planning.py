"""`raylazy.plan`: a checkpoint named by a path, URI or cached model id, found and its headers read through storage,
then planned by the core (`raylazy.core.planner`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .core.checkpoint import Checkpoint
from .core.collector import gc_paused
from .core.costs import CostModel
from .core.mesh import Mesh
from .core.options import PlanOptions, validated
from .core.placements import Uneven
from .core.planner import plan_checkpoint
from .core.plans import Plan
from .core.rules import RulesLike
from .storage import open_checkpoint, storage_for


def make_plan(
    model: str | os.PathLike | Checkpoint,
    tp: int | None = None,
    *,
    pp: int | None = None,
    mesh: Mesh | None = None,
    rules: RulesLike | None = None,
    pp_layers: Sequence[int] | None = None,
    expert_parallel: bool = False,
    keep_mtp: bool = False,
    preset: str | None = "auto",
    uneven: Uneven = "error",
    max_gap: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cost_model: CostModel | None = None,
    request_timeout_s: float = 120.0,
) -> Plan:
    """Plan which bytes of which file every rank of `mesh` (or of `tp` x `pp` ranks) reads. Reads headers only.

    Give `tp` and `pp` or `mesh` (neither: one rank); invalid options are a ConfigurationError. With pipeline
    stages, each stage's ranks get only its tensors (`raylazy.core.stages`: vLLM's layer split, or `pp_layers`
    per stage); with `expert_parallel`, routed experts go whole to the tp ranks of their stage. Multi-token-
    prediction layers (DeepSeek-V3's layer 61) are skipped unless `keep_mtp`. `max_gap` None:
    0 for local files; on object storage each row-split read is fetched whole or row by row, whichever the
    storage's cost model (`raylazy.core.costs`: latency and bandwidth) estimates sooner.
    `storage_options` configure object storage (see `raylazy.storage.objects`). `cost_model`: plan for a storage of
    these costs instead of the checkpoint's own (`raylazy plan --hardware` plans for the hardware's storage).
    A storage request of the planning (a listing, opening a file, reading a header) unanswered for
    `request_timeout_s` seconds raises StorageStallError (`raylazy.storage.open_checkpoint`).
    """
    opts = validated(PlanOptions, tp=tp, pp=pp, mesh=mesh, pp_layers=pp_layers, expert_parallel=expert_parallel,
                     keep_mtp=keep_mtp, preset=preset, uneven=uneven, max_gap=max_gap)
    with gc_paused():  # the headers are most of the small objects too
        ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model, storage_options, request_timeout_s)
        storage = storage_for(ckpt.root, storage_options)
        kind = storage.kind(ckpt.root)
        plan = plan_checkpoint(ckpt, opts, rules, cost_model or storage.cost_model(ckpt.root, kind))
        return plan.model_copy(update={"storage": kind})
