"""Tiny, obviously-right helpers that execute and check a plan in pure Python.

`apply_reads` runs a shard's reads against raw file bytes, exactly as the Read
docstring says; `reference_shard` builds what a shard holds from the full tensor
and the shard's own pieces: it checks a reader against the plan, not the plan
(which slice a rank gets comes from tests/support/expected.py, the tests' oracle).
"""

from __future__ import annotations

import torch

from raylazy.core.plans import Read, TensorShard


def read_ranges(read: Read) -> list[tuple[int, int, int]]:
    """The `(file offset, shard offset, length)` of each of the read's `count` ranges."""
    return [(read.offset + i * read.stride, read.dst_offset + i * read.dst_stride, read.length) for i in range(read.count)]


def apply_reads(shard: TensorShard, files) -> bytes:
    """The shard's bytes, got by running its reads against `files[read.file]` (raw file bytes).

    A gather read fetches its whole span in one slice, but only its `count` ranges
    are placed in the shard; bytes no read covers stay zero (padding).
    """
    out = bytearray(shard.nbytes)
    for r in shard.reads:
        data = files[r.file]
        if r.gather:
            base = r.offset
            data = bytes(data[r.offset : r.offset + r.span])
            assert len(data) == r.span, f"{shard.name}: gather span runs past the end of file {r.file}"
        else:
            base = 0
        for src, dst, length in read_ranges(r):
            chunk = data[src - base : src - base + length]
            assert len(chunk) == length, f"{shard.name}: range at {src} runs past the end of file {r.file}"
            assert dst + length <= len(out), f"{shard.name}: range lands past the end of the {len(out)}-byte shard"
            out[dst : dst + length] = chunk
    return bytes(out)


def reference_shard(full: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """zeros(shard.shape) with each piece of `full` copied in along `shard.dim` (all of `full` if dim is None): the
    plan's pieces, taken as right (for tests of readers; tests/support/expected.py says which slice is right)."""
    if shard.dim is None:
        return full.clone()
    out = torch.zeros(shard.shape, dtype=full.dtype)
    for src, dst, length in shard.pieces:
        out.narrow(shard.dim, dst, length).copy_(full.narrow(shard.dim, src, length))
    return out


def as_bytes(t: torch.Tensor) -> bytes:
    """The raw little-endian bytes of `t`, on any device (as safetensors stores them)."""
    t = t.detach().cpu().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def read_files(plan) -> list[bytes]:
    """The raw bytes of every file of `plan`, indexed like `Read.file`."""
    out = []
    for f in plan.files:
        with open(f.uri, "rb") as fh:
            out.append(fh.read())
    return out
