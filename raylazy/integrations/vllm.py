"""raylazy as a vLLM load format: `LLM(model, load_format="raylazy")`, `vllm serve DIR --load-format raylazy`.

The `vllm.general_plugins` entry point (`register`) makes the format known in every vLLM process. In each
worker, `RaylazyModelLoader` runs the model's own `load_weights` twice over lazy weights
(`raylazy.integrations.lazy`): the first run reads nothing and notes which region of each checkpoint tensor
the worker's weight loaders take (its tensor-parallel slice; a pipeline stage never takes the layers it does
not hold), the second gets exactly those regions, read in batches by raylazy's reader. Options come from
`model_loader_extra_config` (`LazyOptions`). Each worker logs one line: bytes read against bytes needed.
"""

from __future__ import annotations

import os
import time

import torch
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ..core.checkpoint import Checkpoint
from ..core.plans import FileRef, format_bytes
from ..storage import open_checkpoint
from .lazy import LazyStats, Recording, Serving, lazy_options, lazy_weights

logger = init_logger("vllm.raylazy")

#: The load format's name.
LOAD_FORMAT = "raylazy"


def register() -> None:
    """The `vllm.general_plugins` entry point: registers load_format="raylazy" in this process."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(RaylazyModelLoader)


class RaylazyModelLoader(BaseModelLoader):
    """Loads each worker's regions of a local safetensors checkpoint (a directory, or a model id already in the
    Hugging Face cache: nothing is downloaded) with raylazy's readers."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = lazy_options(load_config.model_loader_extra_config)  # ConfigurationError naming a bad one

    def download_model(self, model_config: ModelConfig) -> None:
        _checkpoint(model_config)

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        t0 = time.perf_counter()
        ckpt = _checkpoint(model_config)
        recording = Recording()
        model.load_weights(lazy_weights(ckpt, recording))
        files = tuple(map(FileRef.of, ckpt.files))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with self.serving(recording, files) as serving:
            loaded = model.load_weights(lazy_weights(ckpt, serving))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info(_summary(rank, serving.stats, ckpt, params, self.options.backend, time.perf_counter() - t0))
        if model_config.quantization is None and loaded is not None:
            # the check vLLM's default loader makes: every parameter was loaded from the checkpoint
            DefaultModelLoader(LoadConfig()).track_weights_loading(model, loaded)

    def serving(self, recording: Recording, files: tuple[FileRef, ...]) -> Serving:
        """What serves the second run's regions: raylazy's reader, in batches (`raylazy.integrations.lazy`)."""
        return Serving(recording, files, self.options)


def _checkpoint(model_config: ModelConfig) -> Checkpoint:
    model = model_config.model
    if model_config.revision and not os.path.exists(model):
        model = f"{model}@{model_config.revision}"
    return open_checkpoint(model)


def _summary(rank: int, s: LazyStats, ckpt: Checkpoint, params: int, backend: str, seconds: float) -> str:
    """The worker's log line: human words, then the numbers as key=value (tests and scripts parse those)."""
    return (
        f"raylazy: rank {rank} read {format_bytes(s.bytes_read)} for {format_bytes(s.bytes_needed)} needed "
        f"({s.bytes_read / max(s.bytes_needed, 1):.3f}x; the checkpoint holds {format_bytes(ckpt.nbytes)}, the "
        f"rank's parameters {format_bytes(params)}) with {backend} in {s.batches} batch(es), {s.requests} "
        f"request(s), {s.read_seconds:.2f} s reading, {seconds:.2f} s in all; {s.opaque_regions} region(s) "
        f"({format_bytes(s.opaque_bytes)}; {s.whole_opaque} whole tensor(s)) read as far as narrowed because "
        f"their slice could not be derived; {s.unplanned_regions} region(s) taken only on the second run "
        f"[rank={rank} bytes_read={s.bytes_read} bytes_needed={s.bytes_needed} checkpoint_bytes={ckpt.nbytes} "
        f"param_bytes={params} requests={s.requests} opaque_regions={s.opaque_regions} "
        f"opaque_bytes={s.opaque_bytes} whole_opaque={s.whole_opaque} unplanned_regions={s.unplanned_regions} "
        f"unplanned_bytes={s.unplanned_bytes}]"
    )
