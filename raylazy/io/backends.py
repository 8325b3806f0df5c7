"""The registry of rank readers (each backend's read function and the driver-side check of what it can read), the
backend each rank uses, and `read_rank`: one rank's plan executed in any process with its backend."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.options import ReaderOptions
from ..core.plans import FileRef, RankPlan
from ..errors import ConfigurationError
from ..storage import local_path
from .stats import Progress, ReadStats


@dataclass(frozen=True)
class Backend:
    """`read(plan, device, *, options, on_progress, out, sources) -> ({name: tensor}, ReadStats)` executes one
    rank's plan in any process (cooperative also takes `node`, its node's `NodeTask`); `check(plan)` raises
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


#: Backends whose ranks read together with the other ranks of their node (the driver gives each a node task).
NODE_BACKENDS = ("cooperative", "exchange")


def backend_for(name: str, peers: int, device: str, files: tuple[FileRef, ...]) -> str:
    """The backend a rank uses for the requested `name`, with `peers` ranks on its node (itself included) and
    loading to `device`. "auto": a rank sharing its node reads cooperatively, through the page cache on the CPU
    ("cooperative") or stripes exchanged over NCCL on a GPU ("exchange"); a rank alone on its node reads its own
    ranges ("ranged": they are already exactly its pages). Files that are not local (object storage) have no
    page cache to share: their node reads go through the exchange (each stripe fetched once per node, gloo on
    CPUs), "cooperative" included."""
    if name != "auto" and name not in NODE_BACKENDS:
        return name
    if name == "auto" and peers < 2:
        return "ranged"
    if any(local_path(f.uri) is None for f in files):
        return "exchange"
    if name == "auto":
        return "cooperative" if device == "cpu" else "exchange"
    return name


def solo_backend(name: str) -> str:
    """The backend a rank reading alone (no node task) uses for the requested `name`: "auto" and the node
    backends read "ranged", the others themselves."""
    return "ranged" if name == "auto" or name in NODE_BACKENDS else name


def read_rank(
    plan: RankPlan,
    device: str = "cpu",
    *,
    options: ReaderOptions = ReaderOptions(),
    node=None,
    on_progress: Progress | None = None,
    out: Mapping | None = None,
    sources: Mapping | None = None,
) -> tuple[dict, ReadStats]:
    """Execute one rank's plan in this process (no Ray needed): ({name: tensor} on `device`, its ReadStats).

    `options.backend` picks the reader. With `node` (the `raylazy.core.schedule.NodeTask` or
    `raylazy.io.exchange.ExchangeTask` the driver made for the rank's node) it is the backend the driver
    chose; without, the rank reads alone: "auto" and the node backends read "ranged". `out` ({name: tensor}):
    shards filled in place and returned as the same tensors (see `raylazy.io.buffers.shard_buffers`:
    BufferMismatchError before any byte is read); the others are allocated. `on_progress(n)` is called as
    bytes land. `sources` ({file index: Source}): files of the plan the caller opened and checked already
    (`raylazy.storage.open_planned`), read as they are and left open. Raises on any failure; a shard of `out`
    may then be partly overwritten.
    """
    backend = options.backend if node is not None else solo_backend(options.backend)
    return get_backend(backend).read(plan, device, options=options, on_progress=on_progress, out=out, sources=sources,
                                     **({"node": node} if node is not None else {}))


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
