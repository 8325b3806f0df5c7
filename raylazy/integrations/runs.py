"""A consumer's run over lazy weights as a load makes it, without vLLM: once, copying out of the page cache as it
asks (`at_once`), or recorded, its regions read (with the node's other processes) and the recording replayed or the
consumer run again (`recorded`). vLLM's worker (`raylazy.integrations.worker`) runs the model's `load_weights` so;
the tests run their own consumers through the same two functions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ..core.options import ServingOptions
from ..io.nodes import NodeGroup
from ..io.regions import RegionReader
from ..io.serving import AtOnce, Serving
from .lazy import lazy_weights
from .recording import Recording, Served, in_place, overlapping, replay, wanted


class Run(NamedTuple):
    """A consumer's run: what it returned, how it was served ("at-once", "replay" or "rerun") and why not a replay
    where it could not be, each region's takes (what a reload takes), and the recording where one was made."""

    got: Any
    mode: str
    why: str
    takes: dict
    recording: Recording | None = None


def at_once(consume: Callable, reads: RegionReader, group: NodeGroup | None) -> Run:
    """`consume(weights)` once, over lazy weights copied out of the page cache as it asks, then this process's part
    in the load's gathering (`AtOnce`: processes that found the checkpoint elsewhere record, and read together
    without it)."""
    with AtOnce(reads, group) as serving:
        got = consume(lazy_weights(reads.ckpt, Served(serving)))
    return Run(got, "at-once", reads.copied_from, dict(serving.taken))


def recorded(consume: Callable, targets: Callable[[], Iterable[torch.Tensor]], reads: RegionReader,
             options: ServingOptions, device: torch.device, group: NodeGroup | None) -> Run:
    """`consume(weights)` recorded over lazy weights, the regions read (with the node's processes), then the
    recording replayed (only into `targets()`: the model's parameters and buffers) or `consume` run again."""
    recording = Recording(reads.read_alone)
    with recording.watching():
        got = consume(lazy_weights(reads.ckpt, recording))
    recording.check_targets(targets())
    replays = options.replay and recording.replayable
    shared = overlapping([c.dst for c in recording.copies]) if replays else set()
    out = in_place(recording.copies, device, shared) if replays else {}
    takes = wanted(recording.copies, None if replays else recording.opaque)
    # a replay reads onto the parameters' device, in batch order where no two destinations overlap; a second run,
    # like vLLM's own loaders, on the CPU
    with Serving(reads, takes, out, group, device if replays else "cpu", replays and not shared) as serving:
        if replays:
            replay(serving, recording.copies)
        else:
            got = consume(lazy_weights(reads.ckpt, Served(serving)))
    reads.stats.count_opaque(recording.opaque)
    # a reload takes each copy's region as a replay or a rerun does, and an opaque one on each of its two runs
    return Run(got, "replay" if replays else "rerun", recording.why_not_replayable,
               wanted(recording.copies, {r: 2 * n for r, n in recording.opaque.items()}), recording)
