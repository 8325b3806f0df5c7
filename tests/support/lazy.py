"""The vLLM format's two steps driven in the test's process, as its loader drives them: a consumer's run recorded
over lazy weights, then replayed (or run again) over the regions served."""

from __future__ import annotations

import torch

from raylazy.core.checkpoint import Checkpoint
from raylazy.core.options import ServingOptions
from raylazy.integrations.lazy import lazy_weights
from raylazy.integrations.recording import Recording, Served, in_place, wanted
from raylazy.integrations.recording import replay as replay_copies
from raylazy.io.regions import RegionReader
from raylazy.io.serving import Serving
from raylazy.storage import open_checkpoint


def load_lazily(model_dir, consume, options=ServingOptions(), replay=True, watch=dict, ordered=False, spy=None, group=None):
    """The loader's two steps: record a run of `consume`, then replay it (or run it again); `watch()`: the
    consumer's own tensors (a dict), which copies may be replayed into; `ordered`: as the Serving's; `spy(serving)`
    before the replay; `group`: the node's processes loading with this one (`NodeGroup`). `model_dir` may be a
    Checkpoint opened already."""
    ckpt = model_dir if isinstance(model_dir, Checkpoint) else open_checkpoint(model_dir, options.reader.storage_options)
    with RegionReader(ckpt, options) as reads:
        rec = Recording(reads.read_alone)
        with rec.watching():
            consume(lazy_weights(ckpt, rec))
        rec.check_targets(list(watch().values()))
        replay = replay and rec.replayable
        out = in_place(rec.copies, torch.device("cpu")) if replay else {}
        with Serving(reads, wanted(rec.copies, None if replay else rec.opaque), out, group,
                     ordered=ordered) as serving:
            if spy:
                spy(serving)
            if replay:
                replay_copies(serving, rec.copies)
            else:
                consume(lazy_weights(ckpt, Served(serving)))
    return rec, reads.stats
