"""Shard buffers: the tensors a reader fills (the caller's, checked, or new ones) and their dtype and shape."""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from ..core.dtypes import itemsize, torch_dtype
from ..core.plans import RankPlan, TensorShard
from ..errors import BufferMismatchError


def shard_layout(shard: TensorShard) -> tuple[object, tuple[int, ...]]:
    """The torch dtype and shape a shard is returned as (sub-byte dtypes: uint8 rows, the last dim in bytes)."""
    if itemsize(shard.dtype) is None:
        rows = prod(shard.shape[:-1])
        shape = tuple(shard.shape[:-1]) + (shard.nbytes // rows,) if rows and shard.nbytes % rows == 0 else (shard.nbytes,)
        return torch_dtype(shard.dtype), shape
    return torch_dtype(shard.dtype), tuple(shard.shape)


def typed(flat, shard: TensorShard):
    """View a shard's flat uint8 buffer with its dtype and shape (sub-byte dtypes stay uint8 rows)."""
    dtype, shape = shard_layout(shard)
    return flat.view(dtype).reshape(shape)


def plan_files(plan: RankPlan) -> list[int]:
    """The plan file indices the rank reads from, in order."""
    return sorted({r.file for t in plan.tensors for r in t.reads})


def shards_of(plan: RankPlan, buffers: list[tuple[object, object]]) -> dict:
    """A reader's result: {name: tensor} of the rank's shards, from the `shard_buffers` it filled."""
    return {t.name: tensor for t, (_, tensor) in zip(plan.tensors, buffers)}


def shard_buffers(torch, plan: RankPlan, dev, out: Mapping | None) -> list[tuple[object, object]]:
    """Per shard of `plan`: (its bytes as a flat uint8 tensor to fill, the tensor to return).

    A shard named in `out` is filled in place: the caller's tensor must have the shard's
    dtype and shape (`shard_layout`), be contiguous and on `dev`, else BufferMismatchError
    before anything is read. Other shards are allocated on `dev`. Padding (bytes no read
    covers) is zeroed either way.
    """
    out = dict(out or {})
    check_buffers(plan, dev, out)
    buffers = []
    for t in plan.tensors:
        padded = t.bytes_needed < t.nbytes
        given = out.get(t.name)
        if given is None:
            flat = (torch.zeros if padded else torch.empty)(t.nbytes, dtype=torch.uint8, device=dev)
            buffers.append((flat, typed(flat, t)))
            continue
        flat = given.detach().reshape(-1).view(torch.uint8)  # detached: a parameter may require grad
        if padded:
            flat.zero_()
        buffers.append((flat, given))
    return buffers


def check_buffers(plan: RankPlan, dev, out: Mapping) -> None:
    """BufferMismatchError unless every tensor of `out` is one of `plan`'s shards, with its dtype and shape,
    contiguous and on `dev` (a torch.device)."""
    unknown = sorted(set(out) - {t.name for t in plan.tensors})
    if unknown:
        raise BufferMismatchError(f"out names {len(unknown)} tensor(s) rank {plan.rank}'s plan does not hold, "
                                  f"e.g. {unknown[:3]}: pass only the plan's tensors")
    for t in plan.tensors:
        if t.name in out:
            _check_buffer(t, out[t.name], dev)


def _check_buffer(shard: TensorShard, given, dev) -> None:
    dtype, shape = shard_layout(shard)
    ok_device = given.device.type == dev.type and (dev.index is None or given.device.index == dev.index)
    if given.dtype != dtype or tuple(given.shape) != shape or not ok_device or not given.is_contiguous():
        state = "contiguous" if given.is_contiguous() else "not contiguous"
        raise BufferMismatchError(
            f"out[{shard.name!r}]: the shard ({shard.dtype} {list(shard.shape)}) needs a contiguous {dtype} "
            f"tensor of shape {list(shape)} on {dev}; given {given.dtype} {list(given.shape)}, {state}, on "
            f"{given.device}"
        )
