"""A vLLM worker's way to a holder of its checkpoint in Ray (`raylazy.hold`): the one module of the integrations
that uses Ray's layer (`raylazy.cluster.holder`), and only where a holder may serve the load: with `holder="auto"`
(the default), where the worker's process is in a Ray cluster already (vLLM's Ray executor) or RAY_ADDRESS names
one, it connects (bounded in time), finds the holder on its node by the checkpoint's root, and takes its chunks
after the holder checked the checkpoint's identity; anything else, or any failure on the way, reads storage and
says why in one log line."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..core.checkpoint import Checkpoint
from ..core.options import ServingOptions
from ..errors import first_line
from ..io.held import Held
from . import forks


def connect_soon(options: ServingOptions) -> None:
    """Where a holder may serve this worker, start connecting to Ray (`raylazy.cluster.holder.connect_soon`): the
    loader's construction calls it, so that it overlaps the model's."""
    if _may_hold(options) and not forks.forked_from_ray:
        from ..cluster.holder import connect_soon as connect

        connect(options.holder_timeout_s)


def taker(options: ServingOptions, logger) -> Callable[[Checkpoint], Held | None]:
    """`take(checkpoint)` for `raylazy.io.regions.opened`: the holder's bytes of it, else None (storage)."""

    def take(ckpt: Checkpoint) -> Held | None:
        if not _may_hold(options):
            return None
        t0 = time.perf_counter()
        try:
            if forks.forked_from_ray:
                raise RuntimeError("this worker was forked from a process connected to Ray, whose state it cannot "
                                   "use: start vLLM's workers with VLLM_WORKER_MULTIPROC_METHOD=spawn")
            from ..cluster.holder import take_checkpoint

            held, name = take_checkpoint(ckpt, options.holder_timeout_s)
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
    return options.holder != "off" and bool(os.environ.get("RAY_ADDRESS") or forks.connected_to_ray())
