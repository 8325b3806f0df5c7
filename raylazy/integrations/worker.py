"""What one vLLM worker does to load its weights with raylazy (`raylazy.integrations.vllm`'s loader calls it): its
checkpoint opened, then either one run of the model's `load_weights` copying each region out of the page cache as it
asks, or a run recorded over lazy weights, the regions read with the node's other workers, and the recording replayed
or the model run again; one line logged (`raylazy.io.report.summary`)."""

from __future__ import annotations

import itertools
import os

import torch
from vllm.config import ModelConfig
from vllm.logger import init_logger

from ..core.checkpoint import Checkpoint
from ..core.options import ServingOptions
from ..errors import PeerFailedError
from ..io.nodes import NodeGroup, ProcessGroupNode
from ..io.regions import opened
from ..io.report import summary
from ..io.stats import Meter
from ..storage import open_checkpoint
from .held import connect_soon, taker
from .reload import keep, weights_for_reload
from .runs import at_once, recorded

logger = init_logger("vllm.raylazy")

__all__ = ["checkpoint", "connect_soon", "load_weights", "reload_weights"]


def load_weights(model: torch.nn.Module, model_config: ModelConfig, options: ServingOptions):
    """Load this worker's weights of `model` from the checkpoint `model_config` names; returns what the model's
    `load_weights` says it loaded (None where the model's loader says nothing)."""
    meter, group, device = Meter(), _workers(), next(model.parameters()).device
    reads, _ = opened(lambda: checkpoint(model_config, options), options, group, lambda reads: None,
                      lambda worker, why, own: own or PeerFailedError(
                          f"worker {worker} could not open the checkpoint ({why}): no weight was written; fix its cause"),
                      taker(options, logger))
    with reads:
        run = at_once(model.load_weights, reads, group) if reads.copies_at_once() else recorded(
            model.load_weights, lambda: itertools.chain(model.parameters(), model.buffers()), reads, options, device,
            group)
    params = sum(p.nbytes for p in model.parameters())  # one call through each vLLM parameter's torch function
    seconds, rchar = meter.elapsed()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    logger.info(summary(rank, reads.stats, reads.ckpt.nbytes, params, run.mode, run.why, rchar, seconds))
    keep(model, model_config, reads.ckpt, run.takes, params)
    return run.got


def reload_weights(model: torch.nn.Module, model_config: ModelConfig, options: ServingOptions):
    """vLLM's in-place reload (`reload_weights`): this worker's regions of the checkpoint `model_config` now names,
    as lazy weights served synchronously (`raylazy.integrations.reload`)."""
    return weights_for_reload(model, model_config, options, checkpoint, _workers(), logger, taker(options, logger))


def checkpoint(model_config: ModelConfig, options: ServingOptions) -> Checkpoint:
    """The checkpoint a model config names: the loader's one way to its files. For a model in object storage vLLM
    keeps the URI in `model_weights` (`model` is a local directory of its config files): the weights are read
    from there, reached with the options' `storage_options` (else the environment)."""
    model = model_config.model_weights or model_config.model
    if model_config.revision and not model_config.model_weights and not os.path.exists(model):
        model = f"{model}@{model_config.revision}"
    return open_checkpoint(model, options.reader.storage_options, options.reader.request_timeout_s)


def _workers() -> NodeGroup | None:
    """The engine's workers, which load at once (None outside an engine, or where vLLM's world also holds other
    engines' workers: data-parallel replicas need not load when this one does)."""
    from vllm.distributed import parallel_state as ps

    try:
        world, tp, pp = ps.get_world_group(), ps.get_tp_group(), ps.get_pp_group()
    except AssertionError:  # vLLM's groups are not initialised in this process
        return None
    if world.world_size != tp.world_size * pp.world_size:
        return None
    return ProcessGroupNode(world.rank_in_group, world.world_size, world.cpu_group)
