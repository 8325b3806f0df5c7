"""Holders of a checkpoint's bytes in Ray (`raylazy.hold`): per node, one named, detached actor keeps every file of
the checkpoint in Ray's object store, in chunks cut between tensors (`raylazy.io.held`). The first node's holder
reads storage once; the others copy its chunks through Ray's object transfer. A load (`raylazy.load(source=...)`,
the vLLM format) takes the chunks of the holder on its node (else of any node's) as views of the object store, after
the holder checked that it holds the checkpoint as it is on storage now (`raylazy.storage.identity`). Nothing
listens on a port of raylazy's own: the bytes travel as Ray objects, to processes connected to the cluster."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..core.checkpoint import Checkpoint
from ..core.mesh import Mesh
from ..core.options import ReaderOptions
from ..core.plans import FileRef, RankPlan, Read, TensorShard, format_bytes
from ..errors import ConfigurationError, HolderFullError, HolderGoneError, RaylazyError, StaleHolderError, first_line
from ..io.held import Held, as_tensor, chunk_spans
from ..storage import identity, open_checkpoint, open_planned_files, storage_for

log = logging.getLogger("raylazy")

#: The Ray namespace of every holder, found by name from any job of the cluster.
NAMESPACE = "raylazy"
#: Chunks a holder filled from another node's copies at once.
_FETCH_WINDOW = 4
#: Chunks a holder filled from storage reads (and puts) at once.
_READING = 3


def checkpoint_key(root: str) -> str:
    """The part of a holder's name that says which checkpoint (its root, as planned) it holds."""
    return hashlib.sha256(root.encode()).hexdigest()[:16]


def holder_name(root: str, node_id: str) -> str:
    return f"raylazy-holder:{checkpoint_key(root)}:{node_id}"


@dataclass(frozen=True)
class Chunks:
    """What a holder holds: the checkpoint's identity, its files' URIs and sizes, and per file its chunks as (first
    byte, ObjectRef), in order (`raylazy.io.held.chunk_spans`)."""

    identity: str
    uris: list[str]
    sizes: list[int]
    refs: list[list[tuple[int, Any]]]


@dataclass(frozen=True)
class HolderInfo:
    """What one node's holder holds: the checkpoint (its root and identity), its bytes, where they came from
    ("storage", or the node id of the holder it copied), the seconds that took, and its idle release."""

    name: str
    root: str
    identity: str
    node_id: str
    nbytes: int
    filled_from: str
    seconds: float
    idle_s: float | None
    idle_for_s: float


class Holder:
    """The actor of one node's holder (made by `hold`: named, detached, on its node, 0 CPUs). `fill` reads storage,
    `fill_from` copies another holder; `chunks` serves loads; after `idle_s` without one, it releases itself."""

    def __init__(self, root: str, storage_options: dict | None, idle_s: float | None):
        self.root, self.storage_options, self.idle_s = root, storage_options, idle_s
        self.held = Chunks("", [], [], [])
        self.filled_from, self.seconds, self.used = "", 0.0, time.monotonic()
        self.filled = threading.Event()
        if idle_s is not None:
            threading.Thread(target=self._release_when_idle, name="raylazy-holder-idle", daemon=True).start()

    def fill(self, ckpt: Checkpoint, budget_bytes: int | None, reader: ReaderOptions) -> HolderInfo:
        """Read every file of the checkpoint (`ckpt`: its headers, as the caller read them; each file checked against
        them as it is opened) from storage once into the object store: chunk after chunk, `_READING`
        at once (each read into memory of its own, then put: the storage never waits for a put), each with the
        ranged reader shaped by the storage's costs; HolderFullError before any read where they exceed the budget
        (default: this node's object store)."""
        import ray

        from ..io.backends import read_rank

        t0 = time.perf_counter()
        files = tuple(map(FileRef.of, ckpt.files))
        self._check_budget(sum(f.size for f in files), budget_bytes)
        plan = RankPlan(rank=0, mesh=Mesh(), files=files, tensors=tuple(
            TensorShard(name=f"{f}:{a}", file=f, offset=a, dtype="U8", full_shape=(b - a,), shape=(b - a,),
                        placement="held", dim=None, pieces=(), reads=(Read(f, a, b - a, 0),))
            for f, h in enumerate(ckpt.files) for a, b in chunk_spans(h)))
        storage = storage_for(self.root, self.storage_options)
        reader = reader.model_copy(update={"backend": "ranged"}).shaped(storage.cost_model(self.root))

        def read_and_put(chunk: TensorShard) -> Any:  # a chunk read into memory of its own, then put
            got, _ = read_rank(plan.model_copy(update={"tensors": (chunk,)}), "cpu", options=reader, sources=sources)
            return ray.put(got[chunk.name].numpy())

        with open_planned_files(plan, range(len(files)), self.storage_options) as sources, \
                ThreadPoolExecutor(_READING, thread_name_prefix="raylazy-holder-fill") as pool:
            refs = list(pool.map(read_and_put, plan.tensors))
        it = iter(refs)
        self._filled(Chunks(identity(files), [f.uri for f in files], [f.size for f in files],
                            [[(a, next(it)) for a, _ in chunk_spans(h)] for h in ckpt.files]), "storage", t0)
        return self.info()

    def fill_from(self, other, other_node: str, identity: str, budget_bytes: int | None) -> HolderInfo:
        """Copy the chunks of another node's holder (`other`, on node `other_node`) through Ray's object transfer, a
        few at once, into objects of this one: no byte from storage."""
        import ray

        t0 = time.perf_counter()
        theirs: Chunks = ray.get(other.chunks.remote(identity))
        self._check_budget(sum(theirs.sizes), budget_bytes)
        flat = [(f, a, ref) for f, c in enumerate(theirs.refs) for a, ref in c]
        mine: list[list] = [[] for _ in theirs.refs]
        for i in range(0, len(flat), _FETCH_WINDOW):
            window = flat[i : i + _FETCH_WINDOW]
            for (f, a, _), array in zip(window, ray.get([r for _, _, r in window])):
                mine[f].append((a, ray.put(array)))
        self._filled(Chunks(identity, theirs.uris, theirs.sizes, mine), other_node, t0)
        return self.info()

    def chunks(self, identity: str) -> Chunks:
        """What it holds, for a load of the checkpoint whose identity is `identity` now; a StaleHolderError where it
        is not the one held. Waits for a fill under way."""
        self.filled.wait()
        self.used = time.monotonic()
        if identity != self.held.identity:
            raise StaleHolderError(
                f"{self.root}: this node's holder keeps the checkpoint as it was when held (identity {self.held.identity}), "
                f"but it is {identity} on storage now (a file rewritten, replaced or resized): nothing is served from "
                f"it; hold it again to refresh it (raylazy hold {self.root}), or release it")
        return self.held

    def info(self) -> HolderInfo:
        import ray

        ctx = ray.get_runtime_context()
        return HolderInfo(name=holder_name(self.root, ctx.get_node_id()), root=self.root, identity=self.held.identity,
                          node_id=ctx.get_node_id(), nbytes=sum(self.held.sizes), filled_from=self.filled_from,
                          seconds=self.seconds, idle_s=self.idle_s, idle_for_s=time.monotonic() - self.used)

    def _filled(self, held: Chunks, source: str, t0: float) -> None:
        self.held, self.filled_from = held, source
        self.seconds, self.used = time.perf_counter() - t0, time.monotonic()
        self.filled.set()

    def _check_budget(self, nbytes: int, budget_bytes: int | None) -> None:
        budget = budget_bytes if budget_bytes is not None else object_store_bytes()
        if nbytes > budget:
            raise HolderFullError(
                f"{self.root}: holding it takes {format_bytes(nbytes)} of this node's object store, over its budget "
                f"of {format_bytes(budget)} ({'budget_bytes' if budget_bytes is not None else 'the object store'}): "
                "give a larger budget_bytes, or start the node with a larger --object-store-memory")

    def _release_when_idle(self) -> None:
        import ray

        while True:
            time.sleep(min(self.idle_s, 5.0))
            if self.filled.is_set() and time.monotonic() - self.used > self.idle_s:
                log.info("raylazy: releasing the holder of %s after %.0f s unused", self.root, self.idle_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return


def object_store_bytes() -> int:
    """This node's object store capacity."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    return int(next(n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["NodeID"] == me))


@dataclass
class HeldModel:
    """The holders of one checkpoint (`hold`'s answer, or `find`'s): its root and identity, and per node id the
    holder actor. `release()` ends them; they outlive the process that made them until then (or their idle time)."""

    root: str
    identity: str
    actors: dict[str, Any]

    def infos(self) -> list[HolderInfo]:
        import ray

        return ray.get([a.info.remote() for a in self.actors.values()])

    def summary(self) -> str:
        infos = self.infos()
        return (f"raylazy: holding {self.root} ({format_bytes(max((i.nbytes for i in infos), default=0))}) on "
                f"{len(infos)} node(s): " + ", ".join(
                    f"{i.node_id[:8]} from {i.filled_from if i.filled_from == 'storage' else i.filled_from[:8]} in "
                    f"{i.seconds:.2f} s" for i in infos))

    def release(self) -> None:
        """End every holder of it (idempotent): their objects leave the object store."""
        import ray

        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  (gone already)
                pass
        self.actors = {}


def hold(model_dir: str, *, nodes: int | list[str] | None = None, budget_bytes: int | None = None,
         idle_s: float | None = None, storage_options: dict | None = None, timeout_s: float = 1800.0,
         **reader: Any) -> HeldModel:
    """Keep the checkpoint `model_dir` (a directory, URI or cached model id) in Ray's object store on `nodes` (every
    alive node; a number: that many, this process's node first; or their node ids), read from storage once: one
    node's holder reads it, the others copy it from there. A checkpoint already held as it is now is not read again
    (a node that lacks it copies it); one held as it was before (changed since) is released and held afresh.

    `budget_bytes`: the most object-store bytes one node's holder may take (default: the node's object store); over
    it, HolderFullError before a byte is read. `idle_s`: a holder no load took from for that long releases itself
    (default: never; `HeldModel.release`, `raylazy hold --release`). The reader options (`ReaderOptions`: threads,
    request_timeout_s, ...) shape the read from storage. A failure releases every holder this call made, and raises it."""
    import ray

    from ..core.options import validated
    from .bundles import ensure_ray

    options = validated(ReaderOptions, **reader)
    ensure_ray()
    ckpt = open_checkpoint(model_dir, storage_options, options.request_timeout_s)
    root, ident = ckpt.root, identity(map(FileRef.of, ckpt.files))
    found = find(root)
    if found is not None and any(i.identity != ident for i in found.infos()):
        log.info("raylazy: %s changed since it was held: holding it afresh", root)
        found.release()
        found = None
    held = found or HeldModel(root, ident, {})
    made = {}
    try:
        for node in _node_ids(nodes):
            if node not in held.actors:
                made[node] = ray.remote(Holder).options(
                    name=holder_name(root, node), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                    max_concurrency=8, max_restarts=0, scheduling_strategy=_on(node),
                ).remote(root, storage_options, idle_s)
        if made and not held.actors:  # the first reads storage, the others copy it
            first = next(iter(made))
            ray.get(made[first].fill.remote(ckpt, budget_bytes, options), timeout=timeout_s)
            held.actors[first] = made[first]
        node, source = next(iter(held.actors.items()))
        ray.get([a.fill_from.remote(source, node, ident, budget_bytes) for n, a in made.items()
                 if n not in held.actors], timeout=timeout_s)
    except BaseException as e:  # noqa: BLE001  (whatever ends it, the holders it made go, and it is raised)
        HeldModel(root, ident, made).release()
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise HolderGoneError(f"{root}: holding it took more than timeout_s={timeout_s} s: nothing is held "
                                  "by this call") from None
        if isinstance(getattr(e, "cause", None), RaylazyError):  # a holder's own error, as it raised it
            raise e.cause from None
        raise
    held.actors.update(made)
    log.info("%s", held.summary())
    return held


def find(model_dir_or_name: str) -> HeldModel | None:
    """The holders of a checkpoint (its root as planned, or a holder's name) in this cluster, None where none is."""

    key = model_dir_or_name.split(":")[1] if model_dir_or_name.startswith("raylazy-holder:") else \
        checkpoint_key(model_dir_or_name)
    alive = _answering(_names(key))
    if not alive:
        return None
    info = next(iter(alive.values()))[1]
    return HeldModel(info.root, info.identity, {n.rsplit(":", 1)[1]: a for n, (a, _) in alive.items()})


def holders() -> list[HolderInfo]:
    """Every holder in this cluster (`raylazy hold --list`)."""
    return [info for _, info in _answering(_names("")).values()]


def _answering(names: list[str]) -> dict[str, tuple[Any, HolderInfo]]:
    """The holders named, with their infos, that still answer: one that released itself (or was released) after
    it was listed is gone, and left out."""
    import ray

    asked = {}
    for n in names:
        try:
            actor = ray.get_actor(n, namespace=NAMESPACE)
        except ValueError:  # gone since it was listed
            continue
        asked[n] = (actor, actor.info.remote())
    alive = {}
    for n, (actor, ref) in asked.items():
        try:
            alive[n] = (actor, ray.get(ref))
        except ray.exceptions.RayActorError:  # died since it was listed
            continue
    return alive


def take(root: str, ident: str, timeout_s: float) -> tuple[Held, str]:
    """In a loading process connected to the cluster: the chunks of the holder of `root` on this node (else of
    another node's: Ray's object transfer brings them) as tensors over the object store, no byte copied, after the
    holder checked that it holds `ident` (StaleHolderError where not); with the holder's name. HolderGoneError where
    no holder answers within `timeout_s`."""
    import ray

    here = holder_name(root, ray.get_runtime_context().get_node_id())
    names = sorted(_names(checkpoint_key(root)), key=lambda n: n != here)
    deadline, last = time.monotonic() + timeout_s, None
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            chunks: Chunks = ray.get(actor.chunks.remote(ident), timeout=max(deadline - time.monotonic(), 0.01))
            arrays = iter(ray.get([r for c in chunks.refs for _, r in c], timeout=max(deadline - time.monotonic(), 0.01)))
        except StaleHolderError as e:
            raise getattr(e, "cause", e) from None
        except Exception as e:  # noqa: BLE001  (died, released, too slow: the next, else HolderGoneError)
            last = e
            continue
        return Held(chunks.uris, [[(a, as_tensor(next(arrays))) for a, _ in c] for c in chunks.refs]), name
    why = f"the last one: {type(last).__name__}: {first_line(last)}" if last else "none is held in this Ray cluster"
    raise HolderGoneError(f"{root}: no holder of it served this load ({why})")


def take_checkpoint(ckpt, timeout_s: float) -> tuple[Held, str]:
    """`take` for a checkpoint whose headers this process read (a `Checkpoint`: its identity from them), this process
    connected to Ray first (`connect`), all within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    connect(timeout_s)
    return take(ckpt.root, identity(map(FileRef.of, ckpt.files)), max(deadline - time.monotonic(), 0.01))


#: The connection `connect_soon` started, which `connect` waits for.
_connecting: threading.Thread | None = None


def connect_soon(timeout_s: float) -> None:
    """Start `connect` on a thread of its own (importing Ray takes a few tenths of a second): a vLLM loader's
    construction calls it, so that it overlaps vLLM's construction of the model. A failure there is met again by
    the next `connect`."""
    global _connecting
    if _connecting is None:
        _connecting = threading.Thread(target=_connect_quietly, args=(timeout_s,), daemon=True,
                                       name="raylazy-ray-connect")
        _connecting.start()


def _connect_quietly(timeout_s: float) -> None:
    try:
        connect(timeout_s)
    except Exception:  # noqa: BLE001  (met again by the next `connect`, whose caller says it)
        pass


def connect(timeout_s: float) -> None:
    """Connect this process to the Ray cluster RAY_ADDRESS names, unless it is connected: first a TCP connection
    to its GCS, within `timeout_s` (a cluster that is gone fails here, not in Ray's own retries). Waits for the
    connection `connect_soon` started, if any."""
    if _connecting is not None and _connecting is not threading.current_thread():
        _connecting.join(timeout_s)
    import ray

    if ray.is_initialized():
        return
    from ray._private.services import canonicalize_bootstrap_address

    address = os.environ.get("RAY_ADDRESS", "")
    if address.startswith("ray://"):
        raise ConfigurationError(f"RAY_ADDRESS={address} is a Ray Client address, through which the object store "
                                 "cannot be mapped: give the cluster's GCS address (host:port)")
    gcs = canonicalize_bootstrap_address(address)
    if not gcs:
        raise HolderGoneError(f"RAY_ADDRESS={address!r} names no running Ray cluster")
    host, port = gcs.rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=timeout_s).close()
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)


def _names(key: str) -> list[str]:
    """The names of the holders whose checkpoint key is `key` (all holders for "")."""
    import ray

    prefix = f"raylazy-holder:{key}"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))


def _node_ids(nodes: int | list[str] | None) -> list[str]:
    """The alive nodes `hold` keeps a checkpoint on (this process's node first)."""
    import ray

    alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    here = ray.get_runtime_context().get_node_id()
    alive.sort(key=lambda n: n != here)
    if nodes is None:
        return alive
    if isinstance(nodes, int):
        if not 1 <= nodes <= len(alive):
            raise ConfigurationError(f"nodes={nodes}: the cluster has {len(alive)} alive node(s)")
        return alive[:nodes]
    if unknown := [n for n in nodes if n not in alive]:
        raise ConfigurationError(f"nodes= names node(s) not alive in this cluster: {', '.join(unknown)}")
    return list(nodes)


def _on(node: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node, soft=False)
