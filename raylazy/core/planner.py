"""Turn a checkpoint's headers (already read) and sharding rules into a Plan of per-rank byte ranges."""

from __future__ import annotations

import re
from functools import partial
from itertools import repeat
from typing import NamedTuple

from ..errors import (
    PartialByteSliceError,
    QuantizedLayoutError,
    ShardingError,
    StageError,
    UnsupportedQuantizationError,
)
from .boxes import Gather, box_reads, gathering, whole_reads
from .checkpoint import Checkpoint
from .collector import gc_paused
from .costs import CostModel
from .header import TensorInfo
from .mesh import Mesh
from .options import PlanOptions
from .placements import Placement, ShardContext, Slicing
from .plans import FileRef, Plan, RankPlan, TensorShard, read_of, shard_of
from .quantization import Following
from .rules import Rule, RulesLike, match, resolve_rules, stage_of
from .stages import layer_index, partition, tensor_stages


class Placed(NamedTuple):
    """How tensors are placed: the placement, the label plans show, the pattern of the rule that chose it,
    whether the placement says which ranks hold a tensor (`Placement.holders`; else all of them), and whether it
    slices by shape alone (`Placement.shape_only`). Shared by every tensor the same rule places the same way."""

    placement: Placement
    label: str
    pattern: str
    holders: bool
    shape_only: bool


def plan_checkpoint(ckpt: Checkpoint, opts: PlanOptions, rules: RulesLike | None = None,
                    cost: CostModel | None = None) -> Plan:
    """Plan which bytes of which file every rank of `opts.mesh` reads, from headers already read (`ckpt`).

    With pipeline stages, each stage's ranks get only its tensors (`raylazy.core.stages`: vLLM's layer split,
    or `opts.pp_layers` per stage); with `opts.expert_parallel`, routed experts go whole to the tp ranks of
    their stage. `opts.max_gap` None: each row-split read is gathered where the storage's `cost` model estimates
    it sooner (the plan's max_gap is then None), or never without one (local files: max_gap 0)."""
    if opts.max_gap is not None or cost is None:
        opts, cost = opts.model_copy(update={"max_gap": opts.max_gap or 0}), None
    with gc_paused():
        return _plan(ckpt, rules, opts, cost)


def _plan(ckpt: Checkpoint, rules: RulesLike | None, opts: PlanOptions, cost: CostModel | None) -> Plan:
    mesh = opts.mesh
    all_rules = resolve_rules(ckpt.config.model_type, rules, opts.preset)
    tensors = list(ckpt.tensors())
    placed, held, skipped = _placements(ckpt, tensors, all_rules, opts)
    stages = _stages(ckpt, opts, all_rules, tensors, placed, held)
    per_rank = _shards(ckpt, tensors, placed, held, stages, opts, cost)
    files = tuple(map(FileRef.of, ckpt.files))
    plan = Plan(
        root=ckpt.root,
        model_type=ckpt.config.model_type,
        mesh=mesh,
        max_gap=opts.max_gap,
        uneven=opts.uneven,
        checkpoint_bytes=ckpt.nbytes,
        files=files,
        skipped=tuple(skipped),
        ranks=tuple(RankPlan(rank=r, mesh=mesh, files=files, tensors=tuple(s)) for r, s in enumerate(per_rank)),
    )
    return with_replicas(plan, mesh.dp)


def _shards(ckpt: Checkpoint, tensors: list[tuple[int, TensorInfo]], placed: list[Placed | None], held: list[str],
            stages: list[tuple[int, ...] | None] | None, opts: PlanOptions,
            cost: CostModel | None) -> list[list[TensorShard]]:
    """Every rank's shards (of one replica: the others are copies), in file order, from each tensor's placement,
    the name it is placed by and its stages (`_placements`, `_stages`; None: one stage). The tp ranks of a stage that
    hold a tensor are asked of its placement once (`holders`), then each is sliced. A companion's placement sees
    its weight's name, and is held by the ranks that hold its weight (asked once for the weight and all its
    companions). A placement that slices by shape alone (`Placement.shape_only`) is asked once per shape,
    dtype, stage and rank: the layers and experts alike share its cut, moved to each tensor's bytes."""
    mesh, cfg = opts.mesh, ckpt.config
    tp, gather = mesh.tp, gathering(opts.max_gap, cost)
    per_rank: list[list[TensorShard]] = [[] for _ in range(mesh.size // mesh.dp)]
    ranks = [[mesh.rank(pp=s, tp=k) for k in range(tp)] for s in range(mesh.pp)]  # stage -> tp rank -> rank
    coords = [[mesh.coords(r) for r in stage] for stage in ranks]
    heads, kv_heads, uneven, ep, experts = (cfg.num_attention_heads, cfg.num_key_value_heads, opts.uneven,
                                            opts.expert_parallel, cfg.num_experts)
    context = lambda s, k, name: _context((k, tp, heads, kv_heads, uneven, name, coords[s][k], ep, experts))  # noqa: E731
    lists = [[per_rank[r] for r in stage] for stage in ranks]
    every, cuts = tuple(range(tp)), {}  # cuts: shape-only cuts
    known = [{} for _ in ranks]  # stage -> weight -> holders
    for (fi, t), p, name, held_by in zip(tensors, placed, held, stages or repeat((0,))):
        if p is None:
            continue
        whole = None  # the shard of all of it, shared by all ranks
        try:
            for s in held_by:
                holders = every
                if p.holders:  # a placement that may leave ranks out
                    holders = known[s].get(name)
                    if holders is None:
                        found = p.placement.holders(t.shape, context(s, 0, name))
                        holders = known[s][name] = every if found is None else found
                if p.shape_only:
                    key = (id(p), t.shape, t.dtype, s)
                    shared = cuts.get(key) or cuts.setdefault(key, [_UNCUT] * tp)
                else:
                    shared = [_UNCUT] * tp
                for k in holders:
                    c = shared[k]
                    if c is _UNCUT:
                        c = shared[k] = _cut(p, t, context(s, k, name), gather)
                    if c is None:
                        whole = whole or shard_of((t.name, fi, t.start, t.dtype, t.shape, t.shape, p.label, None, (),
                                                 whole_reads(fi, t)))
                        lists[s][k].append(whole)
                    else:
                        lists[s][k].append(_moved(c, t.name, fi, t.start))
        except ShardingError as e:
            raise type(e)(f"{ckpt.files[fi].path}: tensor {t.name!r} {list(t.shape)} "
                          f"({p.label}, rule {p.pattern!r}): {e}") from None
    return per_rank


#: A ShardContext from the tuple of all its fields, made in C (one per tensor a placement is asked about).
_context = partial(tuple.__new__, ShardContext)
#: A (rule, layout) not placed yet (`_placements`; None there: its tensors are not loaded).
_UNPLACED = object()
#: A rank's cut not asked of its placement yet (None: the rank takes the whole tensor).
_UNCUT = object()


def _cut(p: Placed, t: TensorInfo, ctx: ShardContext, gather: Gather) -> TensorShard | None:
    """The shard rank `ctx` gets of tensor `t` as if it began at byte 0 of file 0 (`_moved` puts it in place), or
    None when the rank takes all of it."""
    slicing = p.placement.slicing(t.shape, ctx)
    if slicing is None:
        return None
    return tensor_shard(0, t._replace(start=0, end=t.end - t.start), p.label, slicing, gather)


def _moved(cut: TensorShard, name: str, fi: int, start: int) -> TensorShard:
    """`cut` (a shard of a tensor at byte 0 of file 0) as the shard of tensor `name` at byte `start` of file `fi`."""
    reads = tuple([read_of((fi, start + offset, *rest)) for _, offset, *rest in cut.reads])
    return shard_of((name, fi, start, *cut[3:9], reads))


def _placements(ckpt: Checkpoint, tensors: list[tuple[int, TensorInfo]], rules: tuple[Rule, ...],
                opts: PlanOptions) -> tuple[list[Placed | None], list[str], list[str]]:
    """Each tensor's placement (None: not loaded) and the name it is placed by (a companion's weight's, else its
    own), in the order of `tensors`; and the names of the tensors not loaded (in file order).

    A plain tensor gets its rule's placement; a quantized layer's companion (`raylazy.core.quantization`) gets
    its weight's rule, followed at the companion's granularity. Multi-token-prediction layers (config.json's
    num_nextn_predict_layers past the last layer) are not loaded unless `opts.keep_mtp`, as vLLM's main model
    skips them."""
    cfg = ckpt.config
    by_name = {t.name: t for _, t in tensors}
    try:
        layout = cfg.quantization.companions(by_name) if cfg.quantization else {}
    except (QuantizedLayoutError, UnsupportedQuantizationError) as e:
        raise type(e)(f"{ckpt.root}: {e}") from None
    drop = set() if opts.keep_mtp else _mtp_names(cfg, by_name)
    names = [t.name for _, t in tensors]
    found = list(map(layout.get, names)) if layout else repeat(None)  # each tensor's Companion, or None
    held = [c.weight if c else n for n, c in zip(names, found)] if layout else names
    chosen = match(rules, dict.fromkeys([w for n, w in zip(names, held) if n not in drop] if drop else held),
                   cfg.model_type)
    shared: dict[tuple[int, int], Placed | None] = {}  # (rule, companion layout) -> how its tensors are placed
    placed: list[Placed | None] = []
    skipped = dict.fromkeys(drop)
    for name, weight, c in zip(names, held, found):
        rule = None if name in skipped else chosen[weight]
        key = (id(rule), id(c.layout) if c else 0)
        p = shared.get(key, _UNPLACED)
        if p is _UNPLACED:
            if rule is None or not rule.placement.loaded:
                p = None
            else:
                f = Following(rule.placement, c.layout) if c else rule.placement
                p = Placed(f, f.describe(), rule.pattern, type(f).holders is not Placement.holders, f.shape_only())
            shared[key] = p
        if p is None:
            skipped[name] = None
        placed.append(p)
    return placed, held, [n for n in by_name if n in skipped] if skipped else []


def _mtp_names(cfg, tensors) -> set[str]:
    """The tensors of the multi-token-prediction layers: layers [L, L + num_nextn_predict_layers) of a model of L."""
    if not cfg.num_nextn_predict_layers or cfg.num_hidden_layers is None:
        return set()
    mtp = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    mark = re.compile("|".join(rf"layers\.{i}\." for i in mtp)).search
    return {n for n in tensors if mark(n) and layer_index(n) in mtp}


def with_replicas(plan: Plan, dp: int) -> Plan:
    """`plan` for `dp` replicas: replica r's rank plans are replica 0's (the plan's first ranks), with replica r's
    global ranks. Replica 0 is the one that reads from storage; the others copy from it (`raylazy.cluster.loading`)."""
    per = plan.mesh.size // plan.mesh.dp
    mesh = Mesh(**{**plan.mesh.shape, "dp": dp})  # a bad dp is Mesh's ConfigurationError
    ranks = tuple(RankPlan(rank=r * per + i, mesh=mesh, files=plan.files, tensors=rp.tensors)
                  for r in range(dp) for i, rp in enumerate(plan.ranks[:per]))
    return plan.model_copy(update={"mesh": mesh, "ranks": ranks, "nodes": ()})


def _stages(ckpt: Checkpoint, opts: PlanOptions, rules: tuple[Rule, ...], tensors: list[tuple[int, TensorInfo]],
            placed: list[Placed | None], held: list[str]) -> list[tuple[int, ...] | None] | None:
    """The pipeline stages of each tensor of `tensors` (None: not loaded; all None with one stage: everything is
    on stage 0). A companion without a layer index (a quantized head's scale) goes where a stage rule puts its
    weight (`held`: the name each tensor is placed by)."""
    if opts.mesh.pp == 1:
        return None
    cfg = ckpt.config
    layers = cfg.num_hidden_layers or (sum(opts.pp_layers) if opts.pp_layers else None)
    if layers is None:
        raise StageError(f"{ckpt.root}: config.json gives no num_hidden_layers, so the layers cannot be split into "
                         f"{opts.mesh.pp} pipeline stages; add it to config.json, or give pp_layers")
    tied = cfg.tie_word_embeddings
    if tied is None:  # config.json does not say: tied when there is no head of its own
        tied = not any(t.name == "lm_head.weight" for _, t in ckpt.tensors())
    names = [t.name if p else None for (_, t), p in zip(tensors, placed)]
    return tensor_stages(names, held, partition(layers, opts.mesh.pp, opts.pp_layers),
                         lambda n: stage_of(rules, n), tied, cfg.num_nextn_predict_layers if opts.keep_mtp else 0)


def tensor_shard(fi: int, t: TensorInfo, placement: str, slicing: Slicing | None, gather: Gather) -> TensorShard:
    """Tensor `t` of file `fi` as one rank's shard: all of it (`slicing` None) or the slicing's pieces, each a box
    of the tensor (`raylazy.core.boxes`), its strided rows read as one range where `gather` says."""
    shape = t.shape
    if slicing is None:
        return TensorShard(t.name, fi, t.start, t.dtype, shape, shape, placement, None, (), whole_reads(fi, t))
    d, n = slicing.dim, len(shape)
    out, box, at, reads = list(shape), list(shape), [0] * n, ()
    out[d] = slicing.length
    out = tuple(out)
    try:
        for p in slicing.pieces:  # each piece is the box of its entries along d, at its place in the shard
            box[d], at[d] = p.length, p.dst
            reads += box_reads(fi, t, (0,) * d + (p.src,) + (0,) * (n - d - 1), tuple(box), gather, (out, at))
    except PartialByteSliceError as e:
        raise PartialByteSliceError(f"{e}: split another dim, or replicate the tensor") from None
    return TensorShard(name=t.name, file=fi, offset=t.start, dtype=t.dtype, full_shape=shape, shape=out,
                       placement=placement, dim=d, pieces=tuple((p.src, p.dst, p.length) for p in slicing.pieces),
                       reads=reads)
