"""Broken raylazy load formats for the tests (they run in vLLM's workers): `PeerBytesLoader` serves rank 0 each
region's neighbour, the bytes the next rank would take, so the weight check of tests/integrations/test_vllm.py must fail
on rank 0 and hold on the others; `UnopenedLoader`'s rank 1 cannot open the checkpoint."""

from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import torch

from raylazy.core.boxes import Region
from raylazy.errors import CheckpointNotFoundError
from raylazy.integrations.vllm import RaylazyModelLoader
from raylazy.io import regions
from raylazy.io.regions import RegionReader


def neighbour(region: Region) -> Region:
    """The same box one box further along its first narrowed dim (wrapping): what the next rank would take."""
    cut = [d for d, (n, full) in enumerate(zip(region.sizes, region.tensor.shape)) if n != full]
    if not cut:
        return region
    d = cut[0]
    start = (region.starts[d] + region.sizes[d]) % region.tensor.shape[d]
    start = min(start, region.tensor.shape[d] - region.sizes[d])
    return Region(region.file, region.tensor, region.starts[:d] + (start,) + region.starts[d + 1 :], region.sizes)


class PeerBytesLoader(RaylazyModelLoader):
    """raylazy's loader with rank 0 fed another rank's bytes: its reader plans each region's neighbour in its
    place, and a copy out of a file's mapping views the neighbour's box."""

    def load_weights(self, model, model_config) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        shard, box = RegionReader.shard, regions.mapped_box
        with ExitStack() as patches:
            if rank == 0:
                patches.enter_context(mock.patch.object(
                    RegionReader, "shard", lambda reads, region, name: shard(reads, neighbour(region), name)))
                patches.enter_context(mock.patch.object(
                    regions, "mapped_box", lambda mapping, region: box(mapping, neighbour(region))))
            super().load_weights(model, model_config)


class UnopenedLoader(RaylazyModelLoader):
    """raylazy's loader whose rank 1 cannot open the checkpoint: every worker must fail the load at once, naming
    that cause, none waiting for rank 1 in a collective, and the engine serve on."""

    def load_weights(self, model, model_config) -> None:
        def unopened(config, options):
            raise CheckpointNotFoundError(f"{config.model}: {UNOPENED}")

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with mock.patch.object(self.worker, "checkpoint", unopened) if rank == 1 else ExitStack():
            super().load_weights(model, model_config)


#: What rank 1 of `UnopenedLoader` says.
UNOPENED = "the checkpoint cannot be opened on rank 1 (the tests' UnopenedLoader)"
