"""A vLLM worker's way to a holder of its checkpoint in Ray (`raylazy.hold`): the one module of the integrations
that uses Ray's layer (`raylazy.cluster.holder`), and only where a holder may serve the load: with `holder="auto"`
(the default), where the worker's process is in a Ray cluster already (vLLM's Ray executor) or RAY_ADDRESS names
one, it connects (bounded in time), finds the holder on its node by the checkpoint's root, and takes its chunks
after the holder checked the checkpoint's identity; anything else, or any failure on the way, reads storage and
says why in one log line."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from ..core.checkpoint import Checkpoint
from ..core.options import ServingOptions
from ..core.plans import FileRef
from ..errors import first_line
from ..io.held import Held
from ..storage import identity
from . import forks

#: The connection to Ray the loader's construction started (`connect_soon`), waited for before a holder is asked.
_connecting: threading.Thread | None = None


def connect_soon(options: ServingOptions) -> None:
    """Where a holder may serve this worker, start connecting to Ray (importing it takes a few tenths of a second)
    on a thread of its own: the loader's construction calls it, so that it overlaps the model's. A failure there
    is met again, and said, when the load asks for its holder."""
    global _connecting
    if _connecting is None and _may_hold(options) and not forks.forked_from_ray:
        _connecting = threading.Thread(target=_connect, args=(options.holder_timeout_s,), daemon=True,
                                       name="raylazy-ray-connect")
        _connecting.start()


def _connect(timeout_s: float) -> None:
    try:
        from ..cluster.holder import connect

        connect(timeout_s)
    except Exception:  # noqa: BLE001  (met again by `take`, which says it)
        pass


def taker(options: ServingOptions, logger) -> Callable[[Checkpoint], Held | None]:
    """`take(checkpoint)` for `raylazy.io.regions.opened`: the holder's bytes of it, else None (storage)."""

    def take(ckpt: Checkpoint) -> Held | None:
        if not _may_hold(options):
            return None
        t0 = time.perf_counter()
        if _connecting is not None:
            _connecting.join(options.holder_timeout_s)
        try:
            if forks.forked_from_ray:
                raise RuntimeError("this worker was forked from a process connected to Ray, whose state it cannot "
                                   "use: start vLLM's workers with VLLM_WORKER_MULTIPROC_METHOD=spawn")
            from ..cluster.holder import connect
            from ..cluster.holder import take as take_held

            connect(options.holder_timeout_s)
            held, name = take_held(ckpt.root, identity(map(FileRef.of, ckpt.files)),
                                   max(options.holder_timeout_s - (time.perf_counter() - t0), 0.01))
        except Exception as e:  # noqa: BLE001  (storage serves the load instead: said here)
            logger.warning("raylazy: reading %s from storage: no holder served it (%s: %s)", ckpt.root,
                           type(e).__name__, first_line(e))
            return None
        logger.info("raylazy: taking %s from its holder %s (%.2f s to map its chunks)", ckpt.root, name,
                    time.perf_counter() - t0)
        return held

    return take


def _may_hold(options: ServingOptions) -> bool:
    """Whether a holder may serve this worker: the options allow one, and a Ray cluster is at hand."""
    return options.holder != "off" and bool(os.environ.get("RAY_ADDRESS") or _connected())


def _connected() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())
