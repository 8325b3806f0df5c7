"""The options of `raylazy.load` and its readers: pure data, validated (pydantic) before any actor starts."""

from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigurationError

QUEUE_SIZE_ENV = "RAYLAZY_FASTSAFETENSORS_QUEUE_SIZE"

#: Largest window of a shard one read job fills (bytes).
DEFAULT_CHUNK_BYTES = 16 << 20


class ReaderOptions(BaseModel):
    """What a rank's reader needs: the backend and its knobs (shipped to every actor)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    backend: Literal["ranged", "fastsafetensors"] = "ranged"
    #: Pipeline depth. ranged: staging buffers in flight = queue_size + 2 (-1 = serial).
    #: fastsafetensors: its ParallelLoader queue (-1 serial, 0 one batch in flight, n more prefetch).
    queue_size: int = Field(0, ge=-1, le=64)
    #: Threads issuing positional reads in each rank (ranged backend).
    threads: int = Field(4, ge=1, le=64)
    #: Largest window of a shard one read job fills; staging buffers have this size (ranged).
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=4096)
    #: fastsafetensors: None tries GPUDirect Storage when alone on a node, else nogds.
    nogds: Optional[bool] = None


class LoadOptions(ReaderOptions):
    """Everything `raylazy.load` accepts besides the model and the rules."""

    tp: int = Field(ge=1, le=4096)
    #: "auto": the GPU Ray assigned to the rank's actor, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Reserve one GPU per rank: None = when the cluster has GPUs.
    use_gpu: Optional[bool] = None
    #: CPUs reserved per rank: None = 1, or on a local Ray that raylazy started, an equal share of its CPUs
    #: (min(1, CPUs / tp)), so any tp loads on any machine.
    cpus_per_rank: Optional[float] = Field(None, ge=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    #: Whether an autoscaler may add nodes for a request the cluster cannot place now: None = detect it.
    #: Without one, an unplaceable request fails at once instead of waiting placement_timeout_s.
    autoscale: Optional[bool] = None
    placement_timeout_s: float = Field(300.0, gt=0)
    #: Whole load (after placement) must finish within this many seconds.
    timeout_s: float = Field(1800.0, gt=0)
    #: Times a rank's actor is restarted (and re-reads its plan) after its process dies.
    max_retries: int = Field(2, ge=0)
    #: How shard refs travel: "auto" = object store for CPU shards, CUDA IPC for GPU shards.
    transport: Literal["auto", "object_store", "nccl", "gloo", "nixl", "cuda_ipc"] = "auto"
    #: Show a progress bar: None = when stderr is a terminal.
    progress: Optional[bool] = None
    preset: Optional[str] = "auto"
    uneven: Literal["error", "chunk", "pad"] = "error"
    max_gap: int = Field(0, ge=0)


def load_options(**kwargs) -> LoadOptions:
    """Validate `raylazy.load` keyword options; the fastsafetensors queue size may come from the environment."""
    if kwargs.get("queue_size") is None:
        kwargs.pop("queue_size", None)
        env = os.environ.get(QUEUE_SIZE_ENV)
        if env is not None and kwargs.get("backend") == "fastsafetensors":
            try:
                kwargs["queue_size"] = int(env)
            except ValueError:
                raise ConfigurationError(f"{QUEUE_SIZE_ENV}={env!r} is not an integer (-1, 0 or a positive depth)") from None
    try:
        return LoadOptions(**kwargs)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'options'}={err.get('input')!r}: {err['msg']}" for err in e.errors()
        )
        raise ConfigurationError(f"invalid raylazy.load option(s): {problems}") from None


def reader_options(opts: LoadOptions) -> ReaderOptions:
    return ReaderOptions(**{k: getattr(opts, k) for k in ReaderOptions.model_fields})
