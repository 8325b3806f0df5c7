"""The registry of rank readers (each backend's read function and the driver-side check of what it can read), the
backend and reader options each rank uses, the `NodeRead` a node backend's ranks read together, and `read_rank`: one rank's plan
executed in any process with its backend."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.kinds import StorageKind
from ..core.options import ReaderOptions
from ..core.plans import FileRef, NodeSchedule, Plan, RankPlan
from ..core.schedule import NodeRead, node_backend
from ..errors import ConfigurationError
from ..storage import local_path
from .stats import Progress, ReadStats
from .watch import watched


@dataclass(frozen=True)
class Backend:
    """`read(plan, device, *, options, on_progress, out, sources) -> ({name: tensor}, ReadStats)` executes one
    rank's plan in any process (the node backends also take `node_read`, their node's `NodeRead`); `check(plan)` raises
    ConfigurationError, on the driver before any rank reads, for a rank plan the backend cannot read."""

    name: str
    read: Callable
    check: Callable[[RankPlan], None] | None = None


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    _BACKENDS[backend.name] = backend


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ConfigurationError(f"unknown backend {name!r}: one of {', '.join(sorted(_BACKENDS))}") from None


def check_backend(name: str, plans) -> None:
    """Run backend `name`'s check on every rank plan (raises before anything is read); "auto" picks backends
    without checks."""
    if name == "auto":
        return
    check = get_backend(name).check
    for plan in plans if check else ():
        check(plan)


#: Backends whose ranks read together with the other ranks of their node (each given its node's `NodeRead`).
NODE_BACKENDS = ("cooperative", "exchange")


def backend_for(name: str, peers: int, device: str, files: tuple[FileRef, ...],
                storage: StorageKind | None = None) -> str:
    """The backend a rank uses for the requested `name`, with `peers` ranks on its node (itself included) and
    loading to `device`, the files on `storage`. "auto": a rank sharing its node reads cooperatively, through the
    page cache on the CPU ("cooperative") or stripes exchanged over NCCL on a GPU ("exchange"); a rank alone on
    its node reads its own ranges ("ranged": they are already exactly its pages). Files with no page cache to
    share (object storage, a FUSE mount serving direct_io) are read by the node through the exchange (each stripe
    fetched once per node, gloo on CPUs), "cooperative" included."""
    return node_backend(name, peers, device, shares_page_cache(files, storage))


def shares_page_cache(files: tuple[FileRef, ...], storage: StorageKind | None = None) -> bool:
    """Whether the files are local ones on `storage` whose page cache a mapping of them shares (not object
    storage, not a FUSE mount serving direct_io)."""
    return all(local_path(f.uri) is not None for f in files) and (storage is None or storage.page_cache)


def rank_reader(reader: ReaderOptions, ranks_on_node: int, device: str = "cpu", files: tuple = (),
                storage: StorageKind | None = None) -> ReaderOptions:
    """The rank's reader options: its backend chosen (`backend_for`); fastsafetensors with nogds=None: a rank
    sharing its node with other ranks must not use GDS."""
    reader = reader.model_copy(update={"backend": backend_for(reader.backend, ranks_on_node, device, files, storage)})
    if reader.backend == "fastsafetensors" and reader.nogds is None and ranks_on_node > 1:
        return reader.model_copy(update={"nogds": True})
    return reader


def node_read(backend: str, plan: Plan, schedule: NodeSchedule, load_id: str, address: str = "") -> NodeRead:
    """What every rank of node `schedule` gets to read `plan` with node backend `backend`: the exchange's readers
    send each rank what it keeps, so they get the plans of all the node's ranks (and `address`, where they meet);
    cooperative ranks meet in the page cache and need only the schedule and `load_id`."""
    plans = tuple(plan.ranks[r] for r in schedule.ranks) if backend == "exchange" else ()
    return NodeRead(schedule, plans, load_id, address)


def solo_backend(name: str) -> str:
    """The backend a rank reading alone (no NodeRead) uses for the requested `name`: "auto" and the node
    backends read "ranged", the others themselves."""
    return "ranged" if name == "auto" or name in NODE_BACKENDS else name


def read_rank(
    plan: RankPlan,
    device: str = "cpu",
    *,
    options: ReaderOptions = ReaderOptions(),
    node_read: NodeRead | None = None,
    exchange=None,
    on_progress: Progress | None = None,
    out: Mapping | None = None,
    sources: Mapping | None = None,
) -> tuple[dict, ReadStats]:
    """Execute one rank's plan in this process (no Ray needed): ({name: tensor} on `device`, its ReadStats).

    `options.backend` picks the reader. With `node_read` (its node's `NodeRead`, from `node_read`) it is the node
    backend chosen for the node; without, the rank reads alone: "auto" and the node backends read "ranged".
    `exchange`: for the exchange, the node's `raylazy.io.collective.Exchange`, open already and left open, for a
    caller making several node reads in turn (else the ranks meet at `node_read.address`). `out` ({name: tensor}):
    shards filled in place and returned as the same tensors (see `raylazy.io.buffers.shard_buffers`:
    BufferMismatchError before any byte is read); the others are allocated. `on_progress(n)` is called as
    bytes land. `sources` ({file index: Source}): files of the plan the caller opened and checked already
    (`raylazy.storage.open_planned`), read as they are and left open. The read runs on a thread of its own
    (`raylazy.io.watch`): a storage request unanswered for `options.request_timeout_s` raises StorageStallError.
    Raises on any failure; a shard of `out` may then be partly overwritten, and after a StorageStallError, written
    until the storage answers the requests left blocked: until then `out` is refused to any read
    (BuffersInUseError).
    """
    backend = options.backend if node_read is not None else solo_backend(options.backend)
    together = {k: v for k, v in (("node_read", node_read), ("exchange", exchange)) if v is not None}
    read = get_backend(backend).read
    return watched(lambda: read(plan, device, options=options, on_progress=on_progress, out=out, sources=sources,
                                **together), options.request_timeout_s, out)


def _register_builtin() -> None:
    from .cooperative import read_rank_cooperative
    from .exchange import read_rank_exchanged
    from .fst import check_fastsafetensors, read_rank_fastsafetensors
    from .ranged import read_rank_ranged

    register_backend(Backend("ranged", read_rank_ranged))
    register_backend(Backend("cooperative", read_rank_cooperative))
    register_backend(Backend("exchange", read_rank_exchanged))
    register_backend(Backend("fastsafetensors", read_rank_fastsafetensors, check_fastsafetensors))


_register_builtin()
