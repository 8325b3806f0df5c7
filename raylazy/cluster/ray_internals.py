"""The Ray internals raylazy relies on, each kept here with why no public API serves (docs/design.md names them).

- The GCS's internal key-value store (`ray.experimental.internal_kv`): where a rank keeps its last completed read,
  under its actor id, so that the process Ray restarts after a crash reads it again by itself. Ray has no public
  store that outlives an actor's process and needs no actor of its own; a named actor holding the plans would
  itself have to survive the failures it is there for.
- The autoscaler's status record in that store (`__autoscaling_status`, what `ray status` prints): whether an
  autoscaler may add nodes, so a request the cluster can never place fails at once instead of waiting out
  `placement_timeout_s`. Ray offers no public query of this (`ray.autoscaler.sdk` requests resources; it does
  not say whether anything will answer).
- The driver's tensor-transport registration (`rdt_manager.register_custom_transports_on_actor`): creating an
  actor of a class with tensor transport enabled registers the transports in the creating process first, which
  imports torch there (about 2 CPU s on the driver, after the first rank's actor is submitted and before the
  next ones are). Ray registers them anyway when a transport is first used with the actor
  (`wait_until_custom_transports_registered`), so raylazy creates its ranks with the registration left to then
  (`transports_registered_on_use`); Ray offers no option to defer it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

#: Namespace of raylazy's entries in Ray's internal KV.
KV_NAMESPACE = "raylazy"


def _rank_key(actor_id: str) -> bytes:
    return f"rank/{actor_id}".encode()


def remember_rank(actor_id: str, entry: bytes) -> None:
    """Keep `entry` (a rank's last completed read, pickled) for the actor with this id (hex)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_rank_key(actor_id), entry, overwrite=True, namespace=KV_NAMESPACE)


def remembered_rank(actor_id: str) -> bytes | None:
    """The entry `remember_rank` kept for this actor, if any."""
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(_rank_key(actor_id), namespace=KV_NAMESPACE)


def forget_rank(actor_id: str) -> None:
    """Drop an actor's entry (after a release its restart must not read again)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_rank_key(actor_id), namespace=KV_NAMESPACE)


def autoscaler_can_add_nodes() -> bool:
    """Whether the cluster runs an autoscaler that may add nodes (not Ray's read-only one).

    Reads the status record the autoscaler keeps in the GCS: without an autoscaling config Ray runs a read-only
    autoscaler whose node types are just the running nodes, named `node_<node id>`. Autoscaler v2 keeps no such
    record; it is taken as able to add nodes.
    """
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.experimental.internal_kv import _internal_kv_get

    if is_autoscaler_v2():
        return True
    raw = _internal_kv_get("__autoscaling_status")
    if not raw:
        return False
    mapping = json.loads(raw).get("autoscaler_report", {}).get("node_type_mapping") or {}
    return any(kind != f"node_{node}" for node, kind in mapping.items())


@contextmanager
def transports_registered_on_use() -> Iterator[None]:
    """Actors created in this block (by this process) register their tensor transports on first use, not at
    creation (which imports torch here). Ray's own first-use path (`wait_until_custom_transports_registered`)
    registers them for an actor it has no record of. A Ray without that registration (other versions) creates
    its actors as it does."""
    import ray

    manager = getattr(ray._private.worker.global_worker, "rdt_manager", None)
    if not hasattr(manager, "register_custom_transports_on_actor"):
        yield
        return
    manager.register_custom_transports_on_actor = lambda actor: None  # shadows the method on this instance
    try:
        yield
    finally:  # a concurrent load's block may have ended first and removed it: its creations just register
        manager.__dict__.pop("register_custom_transports_on_actor", None)
