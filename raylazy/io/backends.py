"""The registry of rank readers (each backend's read function and the driver-side check of what it can read), and
`read_rank`: one rank's plan executed in any process with its backend (chosen by `raylazy.core.choices`; the node
reads by `raylazy.io.nodes`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.choices import alone_backend
from ..core.options import ReaderOptions
from ..core.plans import RankPlan
from ..core.schedule import NodeRead
from ..errors import ConfigurationError
from ..storage.watch import watched
from .stats import Progress, ReadStats


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

    `options.backend` picks the reader. With `node_read` (its node's `NodeRead`, from `raylazy.io.nodes`) it is the node
    backend chosen for the node; without, the rank reads alone: "auto" and the node backends read "ranged".
    `exchange`: for the exchange, the node's `raylazy.io.collective.Exchange`, open already and left open, for a
    caller making several node reads in turn (else the ranks meet at `node_read.address`). `out` ({name: tensor}):
    shards filled in place and returned as the same tensors (see `raylazy.io.buffers.shard_buffers`:
    BufferMismatchError before any byte is read); the others are allocated. `on_progress(n)` is called as
    bytes land. `sources` ({file index: Source}): files of the plan the caller opened and checked already
    (`raylazy.storage.open_planned`), read as they are and left open. The read runs on a thread of its own
    (`raylazy.storage.watch`): a storage request unanswered for `options.request_timeout_s` raises StorageStallError.
    Raises on any failure; a shard of `out` may then be partly overwritten, and after a StorageStallError, written
    until the storage answers the requests left blocked: until then `out` is refused to any read
    (BuffersInUseError).
    """
    backend = options.backend if node_read is not None else alone_backend(options.backend)
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
