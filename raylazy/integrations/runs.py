"""A consumer's run over lazy weights as a load makes it, without vLLM: once, copying out of the page cache as it
asks (`at_once`), or recorded, its regions read (with the node's other processes) and the recording replayed or the
consumer run again (`recorded`). vLLM's worker (`raylazy.integrations.worker`) runs the model's `load_weights` so;
the tests run their own consumers through the same two functions."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..core.checkpoint import Checkpoint
from ..core.options import ServingOptions
from ..errors import first_line
from ..io.nodes import NodeGroup
from ..io.regions import RegionReader
from ..io.serving import AtOnce, Serving
from .lazy import lazy_weights
from .recording import Recording, Served, in_place, overlapping, replay, wanted


def opened(ckpt: Callable[[], Checkpoint], options: ServingOptions, group: NodeGroup | None, mine: Callable,
           failure: Callable) -> tuple[RegionReader, list]:
    """The checkpoint (`ckpt()`) opened on this worker, every file checked against its header, then every worker's
    outcome gathered in one gathering before any other collective of the load, so that a worker that failed never
    leaves the others waiting in one: (the reader, every worker's `mine(reader)`). Where one failed, every worker
    raises `failure(worker, why, this worker's error or None)`, the reader closed."""
    reads = error = got = None
    try:
        reads = RegionReader(ckpt(), options)
        reads.sources(range(len(reads.ckpt.files)))
        got = mine(reads)
    except Exception as e:  # noqa: BLE001  (raised below, on every worker)
        error = e
    why = error and f"{type(error).__name__}: {first_line(error)}"
    told = group.gather((why, got))() if group else [(why, got)]
    failed = next(((r, w) for r, (w, _) in enumerate(told) if w), None)
    if failed:
        if reads is not None:
            reads.__exit__(None, None, None)
        raised = failure(*failed, error)
        if raised is error:
            raise error
        raise raised from error
    return reads, [m for _, m in told]


def at_once(consume: Callable, reads: RegionReader, group: NodeGroup | None):
    """`consume(weights)` once, over lazy weights copied out of the page cache as it asks, then this process's part
    in the load's gathering (`AtOnce`: processes that found the checkpoint elsewhere record, and read together
    without it): (what it returned, mode, why, each region's takes)."""
    with AtOnce(reads, group) as serving:
        got = consume(lazy_weights(reads.ckpt, Served(serving)))
    return got, "at-once", "the checkpoint in the page cache", dict(serving.taken)


def recorded(consume: Callable, targets: Callable[[], Iterable[torch.Tensor]], reads: RegionReader,
             options: ServingOptions, device: torch.device, group: NodeGroup | None):
    """`consume(weights)` recorded over lazy weights, the regions read (with the node's processes), then the
    recording replayed (only into `targets()`: the model's parameters and buffers) or `consume` run again: (what
    it returned, mode, why not a replay, each region's takes)."""
    recording = Recording(reads.read_alone)
    with recording.watching():
        got = consume(lazy_weights(reads.ckpt, recording))
    recording.check_targets(targets())
    replays = options.replay and recording.replayable
    out = in_place(recording.copies, device) if replays else {}
    takes = wanted(recording.copies, None if replays else recording.opaque)
    ordered = replays and not overlapping([c.dst for c in recording.copies])  # a replay in batch order
    # a replay reads onto the parameters' device; a second run, like vLLM's own loaders, on the CPU
    with Serving(reads, takes, out, group, device if replays else "cpu", ordered) as serving:
        if replays:
            replay(serving, recording.copies)
        else:
            got = consume(lazy_weights(reads.ckpt, Served(serving)))
    reads.stats.count_opaque(recording.opaque)
    # a reload takes each copy's region as a replay or a rerun does, and an opaque one on each of its two runs
    return (got, "replay" if replays else "rerun", recording.why_not_replayable,
            wanted(recording.copies, {r: 2 * n for r, n in recording.opaque.items()}))
