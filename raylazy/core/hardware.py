"""The hardware a load runs on, as validated data: the storage (bandwidth, latency, connections, page cache), each
node (GPUs, cores, NIC, host-to-device, GPU interconnect, memory copies) and the cluster's fixed costs (an actor's
start, planning). Every figure may carry its source (`sources`: field path -> where the number comes from); the
presets (`hardware_presets.json`, package data) give one for every figure. Read by `raylazy.core.estimate`."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigurationError
from .costs import CostModel

PRESETS_FILE = "hardware_presets.json"


class _Data(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StorageHardware(_Data):
    """Where the checkpoint is: `bandwidth_bps` is what one client node gets at most, `total_bps` what all clients
    together get (0: no shared limit), each request waits `latency_s` for its first byte and then streams at
    `connection_bps`; at most `connections` requests of up to `request_bytes` are in flight per node; `page_cache`:
    the node's processes share the pages one of them read (a local disk, NFS), else every read reaches the storage
    (object storage, an uncached bucket mount)."""

    kind: str = Field(min_length=1)
    bandwidth_bps: float = Field(gt=0)
    total_bps: float = Field(0.0, ge=0)
    latency_s: float = Field(ge=0)
    connection_bps: float = Field(gt=0)
    connections: int = Field(ge=1)
    request_bytes: int = Field(8 << 20, ge=4096)
    page_cache: bool = True

    @property
    def network(self) -> bool:
        return self.kind != "local"

    def cost_model(self) -> CostModel | None:
        """What the planner and readers take a request on this storage to cost (None: local, requests are cheap)."""
        if not self.network:
            return None
        return CostModel(request_s=self.latency_s, connection_bps=self.connection_bps, concurrency=self.connections,
                         part_bytes=self.request_bytes, bandwidth_bps=self.bandwidth_bps)


class NodeHardware(_Data):
    """One node: `gpus` (0: the ranks load to the CPU) and `cores`; `nic_bps` between nodes; `host_to_device_bps`
    per GPU (PCIe); `gpu_link_bps` per GPU between the GPUs of the node (NVLink; on CPUs the exchange's gloo) and
    `exchange_round_s` the fixed cost of one of the exchange's all-to-all rounds;
    `memcpy_bps` one core's copy rate in host memory (page cache to a shard)."""

    gpus: int = Field(ge=0)
    cores: int = Field(ge=1)
    nic_bps: float = Field(gt=0)
    host_to_device_bps: float = Field(gt=0)
    gpu_link_bps: float = Field(gt=0)
    exchange_round_s: float = Field(0.0, ge=0)
    memcpy_bps: float = Field(gt=0)


class ClusterCosts(_Data):
    """Fixed costs: an actor's start (process, imports: `actor_start_s` alone on its cores, plus `actor_cpu_s` of
    work per actor shared by the cores of its host), planning (`plan_s` plus `plan_tensor_s` per tensor, and two
    header requests per file at the storage's latency), each rank's read setup (`read_setup_s`: opening and
    checking its files, its threads), a replica copy's setup (`copy_setup_s`); `shared_host`: all nodes are one
    machine (simulated nodes: one disk, page cache and set of cores)."""

    actor_start_s: float = Field(ge=0)
    actor_cpu_s: float = Field(0.0, ge=0)
    plan_s: float = Field(0.0, ge=0)
    plan_tensor_s: float = Field(0.0, ge=0)
    plan_requests: float = Field(2.0, ge=0)
    read_setup_s: float = Field(0.0, ge=0)
    copy_setup_s: float = Field(0.0, ge=0)
    shared_host: bool = False


class Hardware(_Data):
    """A cluster of `nodes` x `node` reading from `storage`, with its fixed `costs`; `sources` says where each
    figure comes from ("storage.latency_s": "..."), `note` what the description is."""

    name: str = ""
    note: str = ""
    storage: StorageHardware
    node: NodeHardware
    costs: ClusterCosts
    sources: dict[str, str] = Field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cuda" if self.node.gpus else "cpu"

    def source(self, figure: str) -> str:
        """Where `figure` ("node.nic_bps") comes from, "" where not given."""
        return self.sources.get(figure, "")

    def figures(self) -> dict[str, Any]:
        """Every figure by its path ("storage.latency_s": 0.001), in order."""
        return {f"{group}.{k}": v for group in ("storage", "node", "costs")
                for k, v in getattr(self, group).model_dump().items()}


def hardware_from(data: dict | Hardware | str, what: str = "hardware") -> Hardware:
    """A Hardware from a mapping (a parsed file), a preset's name, or one already made; a bad or missing figure is
    a ConfigurationError naming it."""
    if isinstance(data, Hardware):
        return data
    if isinstance(data, str):
        return preset(data)
    try:
        return Hardware.model_validate(data)
    except ValidationError as e:
        raise ConfigurationError.from_validation(e, what) from None


def parse_hardware(text: str, what: str = "hardware file") -> Hardware:
    """A Hardware from JSON or YAML text (YAML needs PyYAML)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError:
            raise ConfigurationError(f"{what} is not JSON, and reading YAML needs PyYAML (pip install pyyaml)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigurationError(f"{what} is neither JSON nor YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{what} must hold a mapping (storage, node, costs), got {type(data).__name__}")
    return hardware_from(data, what)


def presets() -> dict[str, Hardware]:
    """The presets by name, each with the source of every figure (`hardware_presets.json`)."""
    table = json.loads(resources.files(__package__).joinpath(PRESETS_FILE).read_text(encoding="utf-8"))
    return {name: hardware_from({**data, "name": name}, f"preset {name!r}") for name, data in table.items()}


def preset(name: str) -> Hardware:
    table = presets()
    if name not in table:
        raise ConfigurationError(f"no hardware preset {name!r}: one of {', '.join(table)}, or a JSON/YAML file")
    return table[name]
