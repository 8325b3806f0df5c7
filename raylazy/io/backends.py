"""The registry of rank readers: each backend's read function and the driver-side check of what it can read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigurationError
from ..plans import FileRef, RankPlan
from ..storage import local_path


@dataclass(frozen=True)
class Backend:
    """`read(plan, device, *, options, on_progress, out) -> ({name: tensor}, ReadStats)` executes one rank's
    plan in any process (cooperative also takes `node`, its node's `NodeTask`); `check(plan)` raises ConfigurationError, on the driver before any rank reads, for
    a rank plan the backend cannot read."""

    name: str
    read: Callable
    check: Optional[Callable[[RankPlan], None]] = None


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
    ranges ("ranged": they are already exactly its pages). Node backends read local files only: with files
    elsewhere, they read ranged."""
    if name != "auto" and name not in NODE_BACKENDS:
        return name
    if any(local_path(f.uri) is None for f in files) or (name == "auto" and peers < 2):
        return "ranged"
    if name == "auto":
        return "cooperative" if device == "cpu" else "exchange"
    return name


def _register_builtin() -> None:
    from .coop import read_rank_cooperative
    from .coop_exchange import read_rank_exchanged
    from .fst import check_fastsafetensors, read_rank_fastsafetensors
    from .ranged import read_rank

    register_backend(Backend("ranged", read_rank))
    register_backend(Backend("cooperative", read_rank_cooperative))
    register_backend(Backend("exchange", read_rank_exchanged))
    register_backend(Backend("fastsafetensors", read_rank_fastsafetensors, check_fastsafetensors))


_register_builtin()
