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
from ..core.plans import FileRef, RankPlan, format_bytes
from ..storage import open_checkpoint
from .lazy import LazyStats, Recording, Region, Serving, lazy_options, lazy_weights

logger = init_logger("vllm.raylazy")

#: The load format's name.
LOAD_FORMAT = "raylazy"
#: Test hook: the rank (global, as a decimal) this names is served each region's neighbour, another rank's bytes.
PEER_BYTES_ENV = "RAYLAZY_VLLM_TEST_PEER_BYTES"


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
        serving_cls = _PeerServing if os.environ.get(PEER_BYTES_ENV) == str(rank) else Serving
        with serving_cls(recording, files, self.options) as serving:
            loaded = model.load_weights(lazy_weights(ckpt, serving))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info(_summary(rank, serving.stats, ckpt, params, self.options.backend, time.perf_counter() - t0))
        if model_config.quantization is None and loaded is not None:  # as vLLM's default loader checks
            DefaultModelLoader.track_weights_loading(self, model, loaded)


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


def _neighbour(region: Region) -> Region:
    """The same box one box further along its first narrowed dim (wrapping): what the next rank would take."""
    if not region.cut_dims:
        return region
    d = region.cut_dims[0]
    start = (region.starts[d] + region.sizes[d]) % region.tensor.shape[d]
    start = min(start, region.tensor.shape[d] - region.sizes[d])
    return Region(region.file, region.tensor, region.starts[:d] + (start,) + region.starts[d + 1 :], region.sizes)


class _PeerServing(Serving):
    """The test hook of PEER_BYTES_ENV: reads each region's neighbour in its place (a rank fed another's bytes)."""

    def _plan(self, regions: list[Region]) -> RankPlan:
        return super()._plan([_neighbour(r) for r in regions])
