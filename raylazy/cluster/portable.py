"""Shards made safe for Ray's object store: torch pickles float8 tensors but cannot unpickle them
(`UntypedStorage has no attribute dtype`), so they travel as their bytes and come back as themselves."""

from __future__ import annotations


class Portable:
    """{name: tensor} that unpickles as a plain dict of the same tensors, float8 ones carried as uint8 views."""

    def __init__(self, shards: dict):
        self.shards = shards

    def __reduce__(self):
        return (_unpacked, ({name: _packed(t) for name, t in self.shards.items()},))


def portable_shards(rank: int, shards: dict) -> Portable:
    """For `LoadedModel.run`: the rank's shards as they travel through the object store."""
    return Portable(shards)


def _packed(tensor) -> tuple:
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    return (tensor.view(torch.uint8), dtype) if dtype.startswith("float8") else (tensor, None)


def _unpacked(items: dict) -> dict:
    import torch

    return {name: t if dtype is None else t.view(getattr(torch, dtype)) for name, (t, dtype) in items.items()}
