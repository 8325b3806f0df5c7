"""A broken raylazy load format for the tests (runs in vLLM's workers): rank 0 is served each region's neighbour,
the bytes the next rank would take, so the weight check of tests/test_vllm.py must fail on rank 0 and hold on
the others."""

from __future__ import annotations

import torch

from raylazy.integrations.lazy import Region, Serving
from raylazy.integrations.vllm import RaylazyModelLoader


def neighbour(region: Region) -> Region:
    """The same box one box further along its first narrowed dim (wrapping): what the next rank would take."""
    if not region.cut_dims:
        return region
    d = region.cut_dims[0]
    start = (region.starts[d] + region.sizes[d]) % region.tensor.shape[d]
    start = min(start, region.tensor.shape[d] - region.sizes[d])
    return Region(region.file, region.tensor, region.starts[:d] + (start,) + region.starts[d + 1 :], region.sizes)


class NeighbourServing(Serving):
    """Reads each region's neighbour in its place."""

    def _plan(self, regions):
        return super()._plan([neighbour(r) for r in regions])


class PeerBytesLoader(RaylazyModelLoader):
    """raylazy's loader with rank 0 fed another rank's bytes."""

    def serving(self, recording, files):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return (NeighbourServing if rank == 0 else Serving)(recording, files, self.options)
