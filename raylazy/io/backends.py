"""The registry of rank readers: each backend's read function and the driver-side check of what it can read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigurationError
from ..plans import RankPlan


@dataclass(frozen=True)
class Backend:
    """`read(plan, device, *, options, on_progress, out) -> ({name: tensor}, ReadStats)` executes one rank's
    plan in any process; `check(plan)` raises ConfigurationError, on the driver before any rank reads, for
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
    """Run backend `name`'s check on every rank plan (raises before anything is read)."""
    check = get_backend(name).check
    for plan in plans if check else ():
        check(plan)


def _register_builtin() -> None:
    from .fst import check_fastsafetensors, read_rank_fastsafetensors
    from .ranged import read_rank

    register_backend(Backend("ranged", read_rank))
    register_backend(Backend("fastsafetensors", read_rank_fastsafetensors, check_fastsafetensors))


_register_builtin()
