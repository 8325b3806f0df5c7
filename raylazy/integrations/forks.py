"""Whether this process was forked from one connected to Ray (`forked_from_ray`, kept by the hook `watch` installs,
which vLLM's plugin registration calls in every vLLM process): the Ray state such a child inherits is its parent's,
unusable in it, so its worker looks for no holder (`raylazy.integrations.held`)."""

from __future__ import annotations

import os
import sys

forked_from_ray = False
_watching = False


def watch() -> None:
    """From now on, a child forked from this process knows whether this one was connected to Ray (once a process)."""
    global _watching
    if not _watching:
        os.register_at_fork(after_in_child=_forked)
        _watching = True


def connected_to_ray() -> bool:
    """Whether this process is connected to Ray (asked without importing it)."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def _forked() -> None:
    global forked_from_ray
    forked_from_ray = forked_from_ray or connected_to_ray()
