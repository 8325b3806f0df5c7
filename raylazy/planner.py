"""Turn a checkpoint's headers and sharding rules into a Plan of per-rank byte ranges."""

from __future__ import annotations

import os
from math import prod
from typing import Any, Mapping

from .checkpoint import Checkpoint, open_checkpoint
from .dtypes import DTYPE_BITS
from .errors import PartialByteSliceError, ShardingError
from .header import TensorInfo
from .mesh import Mesh
from .options import PlanOptions, validated
from .placements import ShardContext, Slicing, Uneven
from .plans import FileRef, Plan, RankPlan, Read, TensorShard
from .rules import RulesLike, match, resolve_rules
from .storage import storage_for

def make_plan(
    model: str | os.PathLike | Checkpoint,
    tp: int | None = None,
    *,
    mesh: Mesh | None = None,
    rules: RulesLike | None = None,
    preset: str | None = "auto",
    uneven: Uneven = "error",
    max_gap: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Plan:
    """Plan which bytes of which file every rank of `mesh` (or of `tp` ranks) reads. Reads headers only.

    Give `tp` or `mesh` (neither: one rank); invalid options are a ConfigurationError. `max_gap` None: the
    storage's default (0 for local files, `raylazy.objectstore.DEFAULT_MAX_GAP` for object storage).
    `storage_options` configure object storage (see `raylazy.objectstore`).
    """
    opts = validated(PlanOptions, tp=tp, mesh=mesh, preset=preset, uneven=uneven, max_gap=max_gap)
    mesh = opts.mesh
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model, storage_options)
    if opts.max_gap is None:
        opts = opts.model_copy(update={"max_gap": storage_for(ckpt.root, storage_options).default_max_gap})
    cfg = ckpt.config
    chosen = match(resolve_rules(cfg.model_type, rules, opts.preset), (t.name for _, t in ckpt.tensors()))
    coords = [mesh.coords(r) for r in range(mesh.size // mesh.dp)]  # one replica: the others are copies
    per_rank: list[list[TensorShard]] = [[] for _ in coords]
    skipped = []
    for fi, t in ckpt.tensors():
        rule = chosen[t.name]
        placement = rule.placement
        if not placement.loaded:
            skipped.append(t.name)
            continue
        whole = None  # one shard object shared by every rank that gets the whole tensor
        for c, shards in zip(coords, per_rank):
            ctx = ShardContext(c["tp"], mesh.tp, cfg.num_attention_heads, cfg.num_key_value_heads, opts.uneven,
                               t.name, c)
            try:
                slicing = placement.slicing(t.shape, ctx)
            except ShardingError as e:
                raise type(e)(f"{ckpt.files[fi].path}: tensor {t.name!r} {list(t.shape)} "
                              f"({placement.describe()}, rule {rule.pattern!r}): {e}") from None
            if slicing is None:
                if whole is None:
                    whole = _shard(fi, t, placement.describe(), None, opts.max_gap)
                shards.append(whole)
            else:
                shards.append(_shard(fi, t, placement.describe(), slicing, opts.max_gap, ckpt.files[fi].path))
    files = tuple(FileRef(uri=f.path, size=f.file_size, digest=f.digest, version=f.version) for f in ckpt.files)
    plan = Plan(
        root=ckpt.root,
        model_type=cfg.model_type,
        mesh=mesh,
        max_gap=opts.max_gap,
        uneven=opts.uneven,
        checkpoint_bytes=ckpt.nbytes,
        files=files,
        skipped=tuple(skipped),
        ranks=tuple(RankPlan(rank=r, mesh=mesh, files=files, tensors=tuple(s)) for r, s in enumerate(per_rank)),
    )
    return with_replicas(plan, mesh.dp)


def with_replicas(plan: Plan, dp: int) -> Plan:
    """`plan` for `dp` replicas: replica r's rank plans are replica 0's (the plan's first ranks), with replica r's
    global ranks. Replica 0 is the one that reads from storage; the others copy from it (`raylazy.peers`)."""
    per = plan.mesh.size // plan.mesh.dp
    mesh = validated(PlanOptions, mesh=Mesh(**{**plan.mesh.shape, "dp": dp})).mesh
    ranks = tuple(RankPlan(rank=r * per + i, mesh=mesh, files=plan.files, tensors=rp.tensors)
                  for r in range(dp) for i, rp in enumerate(plan.ranks[:per]))
    return plan.model_copy(update={"mesh": mesh, "ranks": ranks, "nodes": ()})


def _shard(fi: int, t: TensorInfo, placement: str, slicing: Slicing | None, max_gap: int, path: str = "") -> TensorShard:
    if slicing is None:
        read = Read(file=fi, offset=t.start, length=t.nbytes, dst_offset=0)
        return TensorShard(name=t.name, file=fi, offset=t.start, dtype=t.dtype, full_shape=t.shape, shape=t.shape, placement=placement,
                           dim=None, pieces=(), reads=(read,) if t.nbytes else ())
    d, shape = slicing.dim, t.shape
    bits = DTYPE_BITS[t.dtype]
    outer, inner_bits = prod(shape[:d]), prod(shape[d + 1 :]) * bits
    reads = []
    for p in slicing.pieces:
        if p.length == 0 or outer == 0 or inner_bits == 0:
            continue
        offs = (p.src * inner_bits, p.length * inner_bits, shape[d] * inner_bits, p.dst * inner_bits,
                slicing.length * inner_bits)
        contiguous = outer == 1 or offs[1] == offs[2] == offs[4]  # one range: only its ends must be whole bytes
        if any(b % 8 for b in ((offs[0], offs[1] * outer, offs[3]) if contiguous else offs)):
            raise PartialByteSliceError(f"{path}: tensor {t.name!r}: the slice [{p.src}:{p.src + p.length}] along dim {d} "
                                        f"of {t.dtype} {list(shape)} does not start and end on whole bytes: split another "
                                        "dim, or replicate the tensor")
        if contiguous:
            reads.append(Read(file=fi, offset=t.start + offs[0] // 8, length=offs[1] * outer // 8,
                              dst_offset=offs[3] // 8))
            continue
        src, length, stride, dst, dst_stride = (b // 8 for b in offs)
        reads.append(Read(file=fi, offset=t.start + src, length=length, dst_offset=dst, count=outer,
                          stride=stride, dst_stride=dst_stride, gather=stride - length <= max_gap))
    out_shape = shape[:d] + (slicing.length,) + shape[d + 1 :]
    return TensorShard(name=t.name, file=fi, offset=t.start, dtype=t.dtype, full_shape=shape, shape=out_shape, placement=placement, dim=d,
                       pieces=tuple((p.src, p.dst, p.length) for p in slicing.pieces), reads=tuple(reads))
