"""The vLLM format's two steps driven in the test's process, as its loader drives them
(`raylazy.integrations.runs.recorded`): a consumer's run recorded over lazy weights, then replayed (or run again)
over the regions served."""

from __future__ import annotations

import torch

from raylazy.core.checkpoint import Checkpoint
from raylazy.core.options import ServingOptions
from raylazy.integrations.runs import recorded
from raylazy.io.regions import RegionReader
from raylazy.storage import open_checkpoint


def load_lazily(model_dir, consume, options=ServingOptions(), replay=True, watch=dict, group=None):
    """The loader's two steps on the CPU: (the recording, the reads' statistics). `replay`: whether a replayable
    recording is replayed (else `consume` runs again); `watch()`: the consumer's own tensors (a dict), which copies
    may be replayed into; `group`: the node's processes loading with this one (`NodeGroup`). `model_dir` may be a
    Checkpoint opened already."""
    ckpt = model_dir if isinstance(model_dir, Checkpoint) else open_checkpoint(model_dir, options.reader.storage_options)
    with RegionReader(ckpt, options) as reads:
        run = recorded(consume, lambda: watch().values(), reads, options.model_copy(update={"replay": replay}),
                       torch.device("cpu"), group)
    return run.recording, reads.stats
