"""Turn a checkpoint's headers and sharding rules into a Plan of per-rank byte ranges."""

from __future__ import annotations

import os
from math import prod

from .checkpoint import Checkpoint, open_checkpoint
from .dtypes import DTYPE_BITS
from .errors import PartialByteError, ShardingError
from .header import TensorInfo
from .placements import ShardContext, Skip, Slicing, Uneven
from .plans import FileRef, Plan, RankPlan, Read, TensorShard
from .rules import RulesLike, match, resolve_rules

#: Default gap (bytes) between a tensor's row ranges below which they are read as one request.
DEFAULT_MAX_GAP = 0


def make_plan(
    model: str | os.PathLike | Checkpoint,
    tp: int,
    *,
    rules: RulesLike | None = None,
    preset: str | None = "auto",
    uneven: Uneven = "error",
    max_gap: int = DEFAULT_MAX_GAP,
) -> Plan:
    """Plan which bytes of which file every one of `tp` ranks reads. Reads headers only."""
    if type(tp) is not int or tp < 1:
        raise ShardingError(f"tp must be a positive integer, got {tp!r}")
    if type(max_gap) is not int or max_gap < 0:
        raise ShardingError(f"max_gap must be a non-negative integer, got {max_gap!r}")
    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    cfg = ckpt.config
    chosen = match(resolve_rules(cfg.model_type, rules, preset), (t.name for _, t in ckpt.tensors()))
    contexts = [ShardContext(r, tp, cfg.num_attention_heads, cfg.num_key_value_heads, uneven) for r in range(tp)]
    per_rank: list[list[TensorShard]] = [[] for _ in range(tp)]
    skipped = []
    for fi, t in ckpt.tensors():
        placement = chosen[t.name].placement
        if isinstance(placement, Skip):
            skipped.append(t.name)
            continue
        if not hasattr(placement, "slicing"):  # replicated: one shard object shared by every rank
            shard = _shard(fi, t, placement.describe(), None, max_gap)
            for shards in per_rank:
                shards.append(shard)
            continue
        for ctx, shards in zip(contexts, per_rank):
            try:
                slicing = placement.slicing(t.shape, ctx)
            except ShardingError as e:
                raise type(e)(f"{ckpt.files[fi].path}: tensor {t.name!r} {list(t.shape)} "
                              f"({placement.describe()}, rule {chosen[t.name].pattern!r}): {e}") from None
            shards.append(_shard(fi, t, placement.describe(), slicing, max_gap, ckpt.files[fi].path))
    files = tuple(FileRef(uri=f.path, size=f.file_size, digest=f.digest) for f in ckpt.files)
    return Plan(
        root=ckpt.root,
        model_type=cfg.model_type,
        tp=tp,
        max_gap=max_gap,
        uneven=uneven,
        checkpoint_bytes=ckpt.nbytes,
        files=files,
        skipped=tuple(skipped),
        ranks=tuple(RankPlan(rank=r, tp=tp, files=files, tensors=tuple(s)) for r, s in enumerate(per_rank)),
    )


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
            raise PartialByteError(path, f"tensor {t.name!r}: a slice along dim {d} of {t.dtype} {list(shape)} "
                                   "does not start and end on whole bytes")
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
