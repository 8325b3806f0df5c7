"""raylazy as a vLLM load format: `LLM(model, load_format="raylazy")`, `vllm serve DIR --load-format raylazy`
(DIR a directory, a cached model id or an `s3://`, `gs://` or `az://` URI; docs/vllm.md).

The `vllm.general_plugins` entry point (`register`) makes the format known in every vLLM process, and imports
nothing of raylazy but this module: raylazy's readers are imported where a loader is made (a worker), so a vLLM
process that does not load with raylazy does not pay for them. In each worker, `RaylazyModelLoader` records the
model's own `load_weights` over lazy weights (`raylazy.integrations.lazy`: which region of each checkpoint tensor
its weight loaders copy where), then reads those regions with raylazy's readers, with the node's other workers,
and replays the copies, or runs `load_weights` again where the recording cannot be replayed
(`raylazy.integrations.worker`, `raylazy.io.serving`). Where the checkpoint is in the page cache
already (for every worker), there is nothing to plan: the one run copies each region out of the files' mappings
as it asks. Options: `model_loader_extra_config` (`ServingOptions`). Each worker logs one line
(`raylazy.io.report.summary`).
"""

from __future__ import annotations

import functools

import torch
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from . import forks

#: The load format's name.
LOAD_FORMAT = "raylazy"


def register() -> None:
    """The `vllm.general_plugins` entry point: registers load_format="raylazy" in this process."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(RaylazyModelLoader)
    _accept_object_storage()
    forks.watch()


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
    nothing is downloaded, or an object-storage URI) with raylazy's readers (`raylazy.integrations.worker`,
    imported when a loader is made, before the load's own step)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        from ..core.collector import gc_paused

        # The first loader in a worker imports raylazy's readers: among its ~6 x 10^5 objects, the collector's
        # passes would cost more than the import. A later one (vLLM makes one for each in-place reload) imports
        # nothing, and its pause makes too little to promote.
        with gc_paused():
            from ..core.options import serving_options
            from . import worker  # raylazy's readers: imported where a loader is made, not in every vLLM process

        self.worker = worker
        self.options = serving_options(load_config.model_loader_extra_config)  # ConfigurationError naming a bad one
        worker.connect_soon(self.options)  # to Ray, where a holder may serve: while vLLM makes the model

    def download_model(self, model_config: ModelConfig) -> None:
        self.worker.checkpoint(model_config, self.options)

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        """The step, with Python's cyclic collector paused throughout: the headers and the recording are up to ~10^5
        small objects among a worker's ~6 x 10^5 of torch's and vLLM's, whose full passes would cost a
        DeepSeek-sized load about 0.5 s. vLLM's `gc.collect()` follows the step at once and takes what it made."""
        from ..core.collector import gc_paused

        with gc_paused(promote=False):
            loaded = self.worker.load_weights(model, model_config, self.options)
            if model_config.quantization is None and loaded is not None:
                # the check vLLM's default loader makes (every parameter was loaded from the checkpoint), on this
                # loader: it reads nothing of a loader but what every BaseModelLoader has
                DefaultModelLoader.track_weights_loading(self, model, loaded)

    def get_all_weights(self, model_config: ModelConfig, model: torch.nn.Module):
        """vLLM's in-place reload (`reload_weights`): this worker's regions of the checkpoint `model_config` now
        names, as lazy weights served synchronously (`raylazy.integrations.reload`)."""
        return self.worker.reload_weights(model, model_config, self.options)
