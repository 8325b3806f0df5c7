"""raylazy as a vLLM load format: `LLM(model, load_format="raylazy")`, `vllm serve DIR --load-format raylazy`
(DIR a directory, a cached model id or an `s3://`, `gs://` or `az://` URI; docs/vllm.md).

The `vllm.general_plugins` entry point (`register`) makes the format known in every vLLM process. In each
worker, `RaylazyModelLoader` records the model's own `load_weights` over lazy weights (`raylazy.integrations.lazy`:
which region of each checkpoint tensor its weight loaders copy where), then reads those regions with raylazy's
readers, with the node's other workers, and replays the copies, or runs `load_weights` again where the recording
cannot be replayed (`raylazy.integrations.serving`). Where the checkpoint is in the page cache already (for every
worker), there is nothing to plan: the one run copies each region out of the files' mappings as it asks.
Options: `model_loader_extra_config` (`LazyOptions`). Each worker logs one line
(`raylazy.integrations.report.summary`).
"""

from __future__ import annotations

import functools
import itertools
import os

import torch
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..core.checkpoint import Checkpoint
from ..io.stats import Meter
from ..storage import open_checkpoint
from .lazy import lazy_weights
from .options import LazyOptions, lazy_options
from .recording import Recording, in_place, overlapping, wanted
from .reload import keep, weights_for_reload
from .report import summary
from .serving import AtOnce, NodeGroup, RegionReader, Serving

logger = init_logger("vllm.raylazy")

#: The load format's name.
LOAD_FORMAT = "raylazy"


def register() -> None:
    """The `vllm.general_plugins` entry point: registers load_format="raylazy" in this process."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(RaylazyModelLoader)
    _accept_object_storage()


def _accept_object_storage() -> None:
    """Let `LLM(model="s3://...", load_format="raylazy")` past vLLM's config check: for an object-storage model
    (its URI in `model_config.model_weights`) `VllmConfig.try_verify_and_update_config` refuses every load format
    but vLLM's own object-storage ones, and a plugin's format cannot say it reads such models. So for raylazy's
    format and such a model only, the check runs with the format named as one it accepts, and raylazy's is put
    back after; once per process; where a vLLM has no such method nothing is changed."""
    from vllm.config import VllmConfig

    check = getattr(VllmConfig, "try_verify_and_update_config", None)
    if check is None or getattr(check, "raylazy", False):
        return

    @functools.wraps(check)
    def verify(self):
        load = self.load_config
        if load.load_format != LOAD_FORMAT or not getattr(self.model_config, "model_weights", ""):
            return check(self)
        load.load_format = "runai_streamer"
        try:
            return check(self)
        finally:
            load.load_format = LOAD_FORMAT

    verify.raylazy = True
    VllmConfig.try_verify_and_update_config = verify


class RaylazyModelLoader(BaseModelLoader):
    """Loads each worker's regions of a safetensors checkpoint (a directory, a model id in the Hugging Face cache:
    nothing is downloaded, or an object-storage URI) with raylazy's readers."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = lazy_options(load_config.model_loader_extra_config)  # ConfigurationError naming a bad one

    def download_model(self, model_config: ModelConfig) -> None:
        _checkpoint(model_config, self.options)

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        meter = Meter()
        ckpt = _checkpoint(model_config, self.options)
        device, group = next(model.parameters()).device, _workers()
        with RegionReader(ckpt, self.options) as reads:
            if reads.copies_at_once():
                loaded, mode, why, takes = _at_once(model, ckpt, reads, group)
            else:
                loaded, mode, why, takes = _recorded(model, ckpt, reads, self.options, device, group)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        seconds, rchar = meter.elapsed()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        logger.info(summary(rank, reads.stats, ckpt.nbytes, params, mode, why, rchar, seconds))
        keep(model, model_config, ckpt, takes, params)
        if model_config.quantization is None and loaded is not None:
            # the check vLLM's default loader makes (every parameter was loaded from the checkpoint), on this
            # loader: it reads nothing of a loader but what every BaseModelLoader has
            DefaultModelLoader.track_weights_loading(self, model, loaded)

    def get_all_weights(self, model_config: ModelConfig, model: torch.nn.Module):
        """vLLM's in-place reload (`reload_weights`): this worker's regions of the checkpoint `model_config` now
        names, as lazy weights served synchronously (`raylazy.integrations.reload`)."""
        return weights_for_reload(model, model_config, self.options, _checkpoint, _workers(), logger)


def _at_once(model: torch.nn.Module, ckpt: Checkpoint, reads: RegionReader, group: NodeGroup | None):
    """The model's `load_weights` once, over lazy weights copied out of the page cache as it asks, then this
    worker's part in the load's gathering (`AtOnce`: workers of the engine that found the checkpoint elsewhere
    record, and read together without it): (what it loaded, mode, why, each region's takes)."""
    with AtOnce(reads, group) as run:
        loaded = model.load_weights(lazy_weights(ckpt, run))
    return loaded, "at-once", "the checkpoint in the page cache", dict(run.taken)


def _recorded(model: torch.nn.Module, ckpt: Checkpoint, reads: RegionReader, options: LazyOptions,
              device: torch.device, group: NodeGroup | None):
    """The model's `load_weights` recorded over lazy weights, the regions read (with the node's workers), then the
    recording replayed or the model run again: (what it loaded, mode, why not a replay, each region's takes)."""
    recording = Recording(reads.read_alone)
    with recording.watching():
        loaded = model.load_weights(lazy_weights(ckpt, recording))
    recording.check_targets(itertools.chain(model.parameters(), model.buffers()))
    replay = options.replay and recording.replayable
    out = in_place(recording.copies, device) if replay else {}
    takes = wanted(recording.copies, None if replay else recording.opaque)
    ordered = replay and not overlapping([c.dst for c in recording.copies])  # a replay in batch order
    # a replay reads onto the parameters' device; a second run, like vLLM's own loaders, on the CPU
    with Serving(reads, takes, out, group, device if replay else "cpu", ordered) as serving:
        if replay:
            serving.replay(recording.copies)
        else:
            loaded = model.load_weights(lazy_weights(ckpt, serving))
    reads.stats.count_opaque(recording.opaque)
    # a reload takes each copy's region as a replay or a rerun does, and an opaque one on each of its two runs
    return (loaded, "replay" if replay else "rerun", recording.why_not_replayable,
            wanted(recording.copies, {r: 2 * n for r, n in recording.opaque.items()}))


def _checkpoint(model_config: ModelConfig, options: LazyOptions) -> Checkpoint:
    """The checkpoint a model config names: the loader's one way to its files. For a model in object storage vLLM
    keeps the URI in `model_weights` (`model` is a local directory of its config files): the weights are read
    from there, reached with the options' `storage_options` (else the environment)."""
    model = model_config.model_weights or model_config.model
    if model_config.revision and not model_config.model_weights and not os.path.exists(model):
        model = f"{model}@{model_config.revision}"
    return open_checkpoint(model, options.reader.storage_options)


class _Workers:
    """vLLM's workers of this engine, over its world group's CPU (gloo) process group."""

    def __init__(self, world):
        self.rank, self.size, self._group = world.rank_in_group, world.world_size, world.cpu_group

    def all_gather(self, obj) -> list:
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self._group)
        return out


def _workers() -> NodeGroup | None:
    """The engine's workers, which load at once (None outside an engine, or where vLLM's world also holds other
    engines' workers: data-parallel replicas need not load when this one does)."""
    from vllm.distributed import parallel_state as ps

    try:
        world, tp, pp = ps.get_world_group(), ps.get_tp_group(), ps.get_pp_group()
    except AssertionError:  # vLLM's groups are not initialised in this process
        return None
    return _Workers(world) if world.world_size == tp.world_size * pp.world_size else None
