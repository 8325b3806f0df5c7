"""The options of `raylazy.plan`, `raylazy.load` and its readers: pure data, validated (pydantic) up front."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigurationError
from .costs import CostModel
from .mesh import Mesh

M = TypeVar("M", bound=BaseModel)

QUEUE_SIZE_ENV = "RAYLAZY_FASTSAFETENSORS_QUEUE_SIZE"

#: Largest window of a shard one read job fills (bytes).
DEFAULT_CHUNK_BYTES = 16 << 20
#: Largest stripe a node's reader reads in one request (cooperative reads).
DEFAULT_STRIPE_BYTES = 16 << 20
#: Staging per rank of the exchanged (GPU) cooperative reads: stripes read ahead plus one round's exchange.
DEFAULT_STAGING_BUDGET = 256 << 20


def validated(model_cls: type[M], **kwargs: Any) -> M:
    """`model_cls(**kwargs)`, with pydantic's ValidationError turned into a ConfigurationError naming each bad field."""
    try:
        return model_cls(**kwargs)
    except ValidationError as e:
        raise ConfigurationError.from_validation(e, f"option(s) ({model_cls.__name__})") from None


class PlanOptions(BaseModel):
    """How `raylazy.plan` plans: the mesh (given as `tp=N, pp=M` or `mesh=Mesh(...)`), the stages' layers,
    expert parallelism, preset, uneven, max_gap."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    mesh: Mesh
    #: Layers per pipeline stage (None: vLLM's even split, `raylazy.core.stages.partition`).
    pp_layers: tuple[Annotated[int, Field(ge=0)], ...] | None = None
    #: Whole routed experts to the tp ranks of their stage (`raylazy.core.placements.Expert`) instead of tp slices.
    expert_parallel: bool = False
    #: Load the multi-token-prediction layers past the last decoder layer (config.json's num_nextn_predict_layers:
    #: DeepSeek-V3's layer 61), on the last stage; by default they are skipped, as vLLM's main model skips them.
    keep_mtp: bool = False
    preset: str | None = "auto"
    uneven: Literal["error", "chunk", "pad"] = "error"
    #: Row gaps of at most this many bytes are read as one request; None: 0 for local files, and on object storage
    #: whichever of whole or row by row the storage's cost model estimates sooner, per read (`raylazy.core.costs`).
    max_gap: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _dims_or_mesh(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        dims = {d: n for d in ("tp", "pp") if (n := data.pop(d, None)) is not None}
        if dims and data.get("mesh") is not None:
            given = ", ".join(f"{d}={n!r}" for d, n in dims.items())
            raise ValueError(f"give {given} or mesh (got {data.get('mesh')!r}), not both")
        if data.get("mesh") is None:  # neither: one rank, as everywhere in raylazy
            data["mesh"] = Mesh(**dims)
        if isinstance(data.get("pp_layers"), list):
            data["pp_layers"] = tuple(data["pp_layers"])
        return data

    @model_validator(mode="after")
    def _one_count_per_stage(self) -> PlanOptions:
        if self.pp_layers is not None and len(self.pp_layers) != self.mesh.pp:
            raise ValueError(f"pp_layers={list(self.pp_layers)} gives {len(self.pp_layers)} stage(s), the mesh has "
                             f"pp={self.mesh.pp}: give one layer count per stage")
        return self

    @property
    def tp(self) -> int:
        return self.mesh.tp


class ReaderOptions(BaseModel):
    """What a rank's reader needs: the backend and its knobs (shipped to every actor)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: "auto": for ranks that share a node, cooperative on CPUs (through stages in shared memory where the storage has
    #: no page cache to share: objects, a direct_io mount) and exchange on GPUs; ranged for a rank alone on its node
    #: (`raylazy.core.choices.choose_backend`).
    backend: Literal["auto", "ranged", "cooperative", "exchange", "fastsafetensors"] = "auto"
    #: Pipeline depth. ranged: staging buffers in flight = queue_size + 2 (-1 = serial).
    #: fastsafetensors: its ParallelLoader queue (-1 serial, 0 one batch in flight, n more prefetch).
    queue_size: int = Field(0, ge=-1, le=64)
    #: Threads issuing positional reads in each rank (ranged; exchange and staged cooperative reads: its stripe
    #: readers).
    threads: int = Field(4, ge=1, le=64)
    #: cooperative: threads per rank that read the rank's stripes of its node's union into the page cache ahead of
    #: the copies (each stripe once, one large request). 0: none; every rank copies its bytes straight out of its
    #: mapping of the files, and the kernel's read-around brings each page in once for the node (measured faster
    #: on CPUs here, docs/cooperative.md; stripe readers read exactly the union, where read-around reads past it).
    stripe_readers: int = Field(0, ge=0, le=64)
    #: Largest window of a shard one read job fills; staging buffers have this size (ranged).
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=4096)
    #: cooperative: largest stripe a node's reader brings into the page cache in one go (nothing is staged;
    #: before Linux 5.14 each reader thread stages one stripe: stripe_readers x stripe_bytes).
    stripe_bytes: int = Field(DEFAULT_STRIPE_BYTES, ge=4096)
    #: cooperative with stripe readers: a keeper waiting this long with no stripe of its becoming ready fails (its
    #: reader died).
    stripe_timeout_s: float = Field(300.0, gt=0)
    #: A storage request (a window, a stripe, a copy out of a mapping) not answered within this many seconds fails
    #: the rank's read (StorageStallError naming the file and the storage kind), and the rank's other reads stop.
    request_timeout_s: float = Field(120.0, gt=0)
    #: exchanged cooperative reads (raylazy.io.exchange): most bytes a rank stages (stripes read ahead,
    #: their device copy, one round's sends and receives); too small for a rank's stripes: ConfigurationError.
    staging_budget: int = Field(DEFAULT_STAGING_BUDGET, ge=4096)
    #: fastsafetensors: None tries GPUDirect Storage when alone on a node, else nogds.
    nogds: bool | None = None
    #: Object storage: credentials, endpoint, client and retry settings (`raylazy.storage.objects`), over the
    #: environment's. Also used to plan. Kept out of reprs (it may hold secrets).
    storage_options: dict[str, str | bool | int | float] = Field(default_factory=dict, repr=False)

    def shaped(self, costs: CostModel | None) -> ReaderOptions:
        """These options with the reads shaped for a storage that costs `costs` (`Storage.cost_model`; None: a
        local disk, nothing changed): as many reader threads as the storage serves requests at once, and windows
        and stripes of the request size it serves well. Options given explicitly are kept."""
        if costs is None:
            return self
        shape = {"threads": min(64, costs.concurrency), "chunk_bytes": max(4096, costs.part_bytes),
                 "stripe_bytes": max(4096, costs.part_bytes)}
        return self.model_copy(update={k: v for k, v in shape.items() if k not in self.model_fields_set})


class PlacementOptions(BaseModel):
    """Where the rank actors run and how they are kept: devices, resources, strategy, waiting, restarts."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: "auto": the GPU Ray assigned to the rank's actor, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: Reserve one GPU per rank: None = when the cluster has GPUs.
    use_gpu: bool | None = None
    #: CPUs reserved per rank: None = 1, or on a local Ray that raylazy started, an equal share of its CPUs
    #: (min(1, CPUs / ranks), ranks being tp x pp x replicas), so any mesh loads on any machine.
    cpus_per_rank: float | None = Field(None, ge=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    #: Whether an autoscaler may add nodes for a request the cluster cannot place now: None = detect it.
    #: Without one, an unplaceable request fails at once instead of waiting placement_timeout_s.
    autoscale: bool | None = None
    placement_timeout_s: float = Field(300.0, gt=0)
    #: Times a rank's actor is restarted (and re-reads its plan) after its process dies.
    max_retries: int = Field(2, ge=0)


class LoadOptions(BaseModel):
    """Everything `raylazy.load` accepts besides the model and the rules, in groups."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    plan: PlanOptions
    reader: ReaderOptions = ReaderOptions()
    placement: PlacementOptions = PlacementOptions()
    #: Whole load (after placement) must finish within this many seconds.
    timeout_s: float = Field(1800.0, gt=0)
    #: How shard refs travel: "auto" = object store for CPU shards, CUDA IPC for GPU shards.
    transport: Literal["auto", "object_store", "nccl", "gloo", "nixl", "cuda_ipc"] = "auto"
    #: How a rank copies its shards from a live replica's rank (`raylazy.cluster.loading`): "auto" = the object store for
    #: CPU shards, NCCL (Ray's direct tensor transport, device to device) for GPU shards.
    peer_transport: Literal["auto", "object_store", "nccl", "gloo"] = "auto"
    #: Show a progress bar: None = when stderr is a terminal.
    progress: bool | None = None

    @property
    def tp(self) -> int:
        return self.plan.tp


#: The option groups of `raylazy.load`, each taking its own keyword options (the plan also takes `tp` and `pp`).
_GROUPS = {"plan": PlanOptions, "reader": ReaderOptions, "placement": PlacementOptions}


def load_options(**kwargs) -> LoadOptions:
    """Validate `raylazy.load`'s flat keyword options into their groups (a ConfigurationError names the bad or
    unknown ones); the fastsafetensors queue size may come from the environment."""
    if kwargs.get("queue_size") is None:
        kwargs.pop("queue_size", None)
        env = os.environ.get(QUEUE_SIZE_ENV)
        if env is not None and kwargs.get("backend") == "fastsafetensors":
            try:
                kwargs["queue_size"] = int(env)
            except ValueError:
                raise ConfigurationError(f"{QUEUE_SIZE_ENV}={env!r} is not an integer (-1, 0 or a positive depth)") from None
    groups: dict[str, dict] = {name: {} for name in _GROUPS}
    top = {}
    for key, value in kwargs.items():
        owner = next((g for g, cls in _GROUPS.items() if key in cls.model_fields or (g == "plan" and key in ("tp", "pp"))),
                     None)
        (groups[owner] if owner else top)[key] = value
    return validated(LoadOptions, **top, **{g: validated(cls, **groups[g]) for g, cls in _GROUPS.items()})


#: Default bytes of regions read per batch (beyond those read straight into their destination).
DEFAULT_BATCH_BYTES = 256 << 20


class ServingOptions(BaseModel):
    """How regions are served to a consumer (`raylazy.io.serving`; the vLLM format's lazy weights): the reader (`ReaderOptions`: backend, threads, queue_size, chunk_bytes, ...),
    row gaps read through (`max_gap`, as for `raylazy.plan`: None, 0 on local files and the storage's cost model
    deciding each strided region on object storage), the batches (about `batch_bytes` of regions each besides
    those read in place; `batches_ahead` read beyond the ones being used: host memory about (batches_ahead + 2)
    x batch_bytes), `replay` (False: a recorded consumer is run a second time, never replayed), `warm_copies`
    (True: where the backend copies out of the files' mappings, "auto" or "cooperative", and the files are in the
    page cache, nothing is recorded: the consumer's one run copies each region out of the mapping as it asks;
    False: always record, read and replay) and `holder` (a holder's bytes, copied out of the object store as they
    are asked, instead of storage)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    reader: ReaderOptions = ReaderOptions()
    max_gap: int | None = Field(None, ge=0)
    batch_bytes: int = Field(DEFAULT_BATCH_BYTES, ge=4096)
    batches_ahead: int = Field(1, ge=0, le=64)
    replay: bool = True
    warm_copies: bool = True
    #: Take the checkpoint's bytes from a holder in Ray (`raylazy.hold`) where one holds it as it is now: "auto"
    #: (where this process is in a Ray cluster already, or RAY_ADDRESS names one), "off" (never: no Ray imported).
    holder: Literal["auto", "off"] = "auto"
    #: Seconds the way to a holder may take (connecting to Ray, finding it, its chunks mapped) before storage is read.
    holder_timeout_s: float = Field(10.0, gt=0)


def serving_options(options: Mapping | None) -> ServingOptions:
    """Validate flat options (the reader's and ServingOptions' own: vLLM's `model_loader_extra_config`): a ConfigurationError names each bad or unknown one."""
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"options must be a mapping of option names to values, got {type(options).__name__}")
    reader = {k: v for k, v in options.items() if k in ReaderOptions.model_fields}
    rest = {k: v for k, v in options.items() if k not in reader}
    return validated(ServingOptions, **rest, reader=validated(ReaderOptions, **reader))
