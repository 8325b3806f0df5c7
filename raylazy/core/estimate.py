"""A load's time from its plan and the hardware: pure data in, data out.

Two steps. `figures` turns a plan (its ranks, the nodes they run on, its replicas) into what each node moves for one
loader: bytes and requests from storage with the requests in flight, bytes each rank copies in host memory,
exchanges with the ranks of its node, moves to its GPU, and copies between nodes for replicas (`LoadFigures`,
exact arithmetic on the plan and its node schedules). `predict` turns those figures and a `Hardware` description
into seconds per phase: actors starting while the driver plans, each node's reads (storage through the
`raylazy.core.costs.CostModel` of the hardware's storage: latency, in-flight depth, request size, bandwidth; host
copies, the exchange and host to device pipelined with it: the node runs at its slowest stage), then the replica
copies; the critical path and its bottleneck named, and every assumption listed (`Estimate`).

Loaders, modelled alike: "raylazy" (the backend `raylazy.load` picks, or the one given), "naive" (every rank reads
the whole tensors its shards come from) and "vllm" (vLLM's default loader: every rank reads every file whole, then
keeps its shards)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..errors import ConfigurationError
from .choices import choose_backend, maps_safely
from .costs import CostModel
from .dtypes import DTYPE_BITS
from .hardware import Hardware, hardware_from
from .options import DEFAULT_STRIPE_BYTES
from .plans import Plan, format_bytes
from .schedule import PAGE, coalesce, minus, node_schedule, node_union, rank_keeps, request_runs, run_span

LOADERS = ("raylazy", "naive", "vllm")
#: Reader threads of a rank on local storage (`ReaderOptions.threads`); on network storage, the storage's connections.
LOCAL_THREADS = 4


@dataclass(frozen=True)
class NodeFigures:
    """What one node's ranks move in one load (bytes per rank in the order of `ranks`)."""

    node: str
    ranks: tuple[int, ...]
    backend: str
    #: From storage: bytes, requests and the requests the node's readers keep in flight.
    storage_bytes: int = 0
    requests: int = 0
    depth: int = 1
    #: Bytes each rank copies in host memory (out of the page cache, or whole tensors it then cuts).
    copy_bytes: tuple[int, ...] = ()
    #: Bytes each rank exchanges with its node's other ranks (the larger of sent and received), and receives.
    exchange_bytes: tuple[int, ...] = ()
    received_bytes: tuple[int, ...] = ()
    #: The exchange's rounds, one after another (each reader's stripes, in turn): one all-to-all each.
    rounds: int = 0
    #: Bytes each rank moves host to device.
    device_bytes: tuple[int, ...] = ()
    #: Replica copies: bytes into this node's ranks from other nodes, out of its ranks to other nodes, within it.
    replica_in: int = 0
    replica_out: int = 0
    replica_local: int = 0


@dataclass(frozen=True)
class LoadFigures:
    """What a load moves, per node, for `loader`: everything `predict` needs from the plan."""

    loader: str
    device: str
    files: int
    tensors: int
    nodes: tuple[NodeFigures, ...]
    #: Whether replica 0 reads from storage (False: every rank copies from a live replica elsewhere).
    from_storage: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LoadFigures:
        nodes = tuple(NodeFigures(**{k: tuple(v) if isinstance(v, list) else v for k, v in n.items()})
                      for n in data["nodes"])
        return cls(**{**data, "nodes": nodes})


def _full_bytes(t) -> int:
    numel = 1
    for d in t.full_shape:
        numel *= d
    return numel * DTYPE_BITS[t.dtype] // 8


def _node_ids(plan: Plan, hw: Hardware, node_ids: Sequence[str] | None, ranks_per_node: int | None) -> list[str]:
    if node_ids is not None:
        if len(node_ids) != len(plan.ranks):
            raise ConfigurationError(f"{len(node_ids)} node id(s) for the plan's {len(plan.ranks)} rank(s): give one "
                                     "per rank")
        return list(node_ids)
    per = ranks_per_node or hw.node.gpus or len(plan.ranks)
    if per < 1:
        raise ConfigurationError(f"ranks_per_node must be at least 1, got {per}")
    return [f"node{r // per}" for r in range(len(plan.ranks))]


def figures(plan: Plan, hardware: Hardware | dict | str, *, loader: str = "raylazy", backend: str = "auto",
            node_ids: Sequence[str] | None = None, ranks_per_node: int | None = None,
            live_source: bool = False) -> LoadFigures:
    """What each node moves when `loader` loads `plan` on `hardware`: ranks on `node_ids` (`node_ids[r]`, rank r's
    node), else `ranks_per_node` a node (default: the node's GPUs, else one node), rank-major. Replica 0 reads from
    storage and the others copy from it (`plan.mesh.dp`); `live_source`: every rank copies from a live replica on
    other nodes, reading nothing."""
    if loader not in LOADERS:
        raise ConfigurationError(f"unknown loader {loader!r}: one of {', '.join(LOADERS)}")
    hw = hardware_from(hardware)
    ids = _node_ids(plan, hw, node_ids, ranks_per_node)
    nodes: dict[str, list[int]] = {}
    for r, n in enumerate(ids):
        nodes.setdefault(n, []).append(r)
    first = len(plan.ranks) // plan.mesh.dp
    seen: dict[int, list[tuple[int, int]]] = {}  # file -> spans an earlier node read into a shared host's page cache
    out = []
    for node, ranks in nodes.items():
        readers = () if live_source else tuple(r for r in ranks if r < first)
        reading = _reading(plan, hw, node, readers, loader, backend, seen) if readers else {}
        out.append(NodeFigures(node=node, ranks=tuple(ranks), backend=reading.pop("backend", "copy"), **reading,
                               **_replicas(plan, ids, node, ranks, first, live_source)))
    tensors = len({t.name for rp in plan.ranks for t in rp.tensors})
    return LoadFigures(loader=loader, device=hw.device, files=len(plan.files), tensors=tensors, nodes=tuple(out),
                       from_storage=not live_source)


def _reading(plan: Plan, hw: Hardware, node: str, ranks: tuple[int, ...], loader: str, backend: str,
             seen: dict) -> dict:
    """The storage, copy, exchange and device figures of one node's reading ranks."""
    st = hw.storage
    name = loader if loader != "raylazy" else \
        choose_backend(backend, len(ranks), hw.device, st.page_cache, mappable=maps_safely(st)).backend
    shards = tuple(sum(t.nbytes for t in plan.ranks[r].tensors) for r in ranks)
    zero = tuple(0 for _ in ranks)
    threads = min(64, st.connections) if st.network else LOCAL_THREADS
    base = dict(backend=name, copy_bytes=zero, exchange_bytes=zero, device_bytes=shards if hw.node.gpus else zero,
                depth=min(st.connections, threads * len(ranks)))
    if name in ("cooperative", "exchange"):
        return base | _together(plan, hw, node, ranks, name, seen, shards)
    if name in ("vllm", "naive"):  # one stream a rank: every file whole, or the whole tensors of its shards
        spans = ([(i, 0, f.size) for i, f in enumerate(plan.files)] * len(ranks) if name == "vllm" else
                 [(t.file, t.offset, t.offset + _full_bytes(t)) for r in ranks for t in plan.ranks[r].tensors])
        copies = (tuple(sum(f.size for f in plan.files) for _ in ranks) if name == "vllm" else
                  tuple(sum(_full_bytes(t) for t in plan.ranks[r].tensors) for r in ranks))
        return base | _storage(spans, hw, seen) | dict(depth=min(st.connections, len(ranks)), copy_bytes=copies)
    # ranged (and fastsafetensors, modelled as ranged reads of the rank's ranges)
    costs = CostModel(request_s=st.latency_s, connection_bps=st.connection_bps, part_bytes=st.request_bytes)
    reads = [costs.read_cost(x) for r in ranks for t in plan.ranks[r].tensors for x in t.reads]
    nbytes = sum(c[1] for c in reads)
    if st.page_cache:  # the node's ranks share pages: the storage serves their union once
        union = node_union(plan, ranks)
        nbytes = _storage([(f, a, b) for f, s in union.items() for a, b in s], hw, seen)["storage_bytes"]
    return base | dict(storage_bytes=nbytes, requests=sum(c[0] for c in reads))


def _together(plan: Plan, hw: Hardware, node: str, ranks: tuple[int, ...], name: str, seen: dict,
              shards: tuple[int, ...]) -> dict:
    """A node backend's figures: the node's union read once in stripes; cooperative ranks copy their shards out of
    the page cache (or, with none, out of the stages their readers fetched the stripes into), exchanging ranks send
    each other what they keep of their stripes, round by round."""
    stripe = hw.storage.request_bytes if hw.storage.network else DEFAULT_STRIPE_BYTES
    staged = name == "cooperative" and not hw.storage.page_cache
    sched = node_schedule(plan, ranks, node, stripe, direct=staged)
    # a cooperative reader's requests are runs of adjacent stripes (`request_runs`), the exchange's its stripes
    runs = [run for r in ranks for run in request_runs(sched, r)] if name == "cooperative" else \
        [(i,) for i in range(len(sched.stripes))]
    read = _storage([(s.file, s.start, s.end) for s in (run_span(sched, run) for run in runs)], hw, seen)
    if name == "cooperative":  # one page-fault stream a rank; staged, the readers' threads, direct stripes not copied
        streams = dict(depth=min(hw.storage.connections, len(ranks))) if hw.storage.page_cache else {}
        direct = [sched.stripes[i] for i in sched.direct]
        return read | streams | dict(copy_bytes=tuple(n - sum(s.end - s.start for s in direct if s.reader == r)
                                                      for r, n in zip(ranks, shards)))
    keeps = {r: rank_keeps(plan, sched, r) for r in ranks}
    reader = [s.reader for s in sched.stripes]
    got = tuple(sum(k.part.bytes_needed for k in keeps[r] if reader[k.stripe] != r) for r in ranks)
    sent = [sum(k.part.bytes_needed for q in ranks if q != r for k in keeps[q] if reader[k.stripe] == r)
            for r in ranks]
    mine = tuple(sum(s.end - s.start for s in sched.stripes if s.reader == r) for r in ranks)
    return read | dict(exchange_bytes=tuple(map(max, got, sent)), received_bytes=got,
                       rounds=max(reader.count(r) for r in ranks),
                       device_bytes=mine if hw.node.gpus else tuple(0 for _ in ranks))


def _storage(spans: list[tuple[int, int, int]], hw: Hardware, seen: dict) -> dict:
    """Bytes and requests reaching the storage for reads of `spans` (file, start, end) by one node: each span its
    requests of at most the storage's request size; with a page cache, each page once per node (and once per
    machine where nodes share a host: `seen` holds the spans earlier nodes read, file -> spans)."""
    part = hw.storage.request_bytes
    if not hw.storage.page_cache:
        return {"storage_bytes": sum(b - a for _, a, b in spans), "requests": sum(-(-(b - a) // part) for _, a, b in spans)}
    by_file: dict[int, list[tuple[int, int]]] = {}
    for f, a, b in spans:
        by_file.setdefault(f, []).append((a - a % PAGE, -(-b // PAGE) * PAGE))
    nbytes = requests = 0
    for f, got in by_file.items():
        union = coalesce(got)
        if hw.costs.shared_host:
            new = minus(union, seen.get(f, []))
            seen[f] = coalesce(seen.get(f, []) + union)
            union = new
        nbytes += sum(b - a for a, b in union)
        requests += sum(-(-(b - a) // part) for a, b in union)
    return {"storage_bytes": nbytes, "requests": requests}


def _replicas(plan: Plan, ids: list[str], node: str, ranks: list[int], first: int, live: bool) -> dict:
    """Replica copy bytes into, out of and within `node`: rank r >= first copies from rank r % first."""
    size = {r: sum(t.nbytes for t in plan.ranks[r].tensors) for r in range(len(plan.ranks))}
    if live:
        return {"replica_in": sum(size[r] for r in ranks)}
    into = sum(size[r] for r in ranks if r >= first and ids[r % first] != node)
    local = sum(size[r] for r in ranks if r >= first and ids[r % first] == node)
    out = sum(size[r] for r in range(first, len(plan.ranks)) if ids[r % first] == node and ids[r] != node)
    return {"replica_in": into, "replica_out": out, "replica_local": local}


@dataclass(frozen=True)
class NodeTime:
    """One node's predicted seconds: its reading stages (pipelined: the node reads at the slowest, plus each rank's
    setup), its replica copies, and what bounds each."""

    node: str
    ranks: tuple[int, ...]
    backend: str
    storage_s: float
    storage_bound: str
    copy_s: float
    exchange_s: float
    device_s: float
    read_s: float
    read_bound: str
    replica_s: float
    replica_bound: str
    actors_s: float


@dataclass(frozen=True)
class Estimate:
    """A load's predicted seconds per phase (`phases`: plan, actors (started while the driver plans: what is left
    after planning), read, copy (replicas), total), per node (`nodes`), the critical path (phase, seconds, what
    bounds it), the bottleneck named, and every assumption behind the numbers. Model output, not a measurement."""

    loader: str
    hardware: str
    phases: dict[str, float]
    nodes: tuple[NodeTime, ...]
    critical_path: tuple[tuple[str, float, str], ...]
    bottleneck: str
    assumptions: tuple[str, ...] = field(default=())

    @property
    def total_s(self) -> float:
        return self.phases["total"]

    def rank_seconds(self) -> dict[int, dict[str, float]]:
        """Each rank's predicted timeline (seconds from the load's call): its read's start and end, and its copy's."""
        read_at = self.phases["plan"] + self.phases["actors"]
        out = {}
        for n in self.nodes:
            for r in n.ranks:
                out[r] = {"read_start": read_at, "read_end": read_at + n.read_s,
                          "copy_end": read_at + self.phases["read"] + n.replica_s}
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """The phases, each node's stages and the bottleneck, as `raylazy plan --estimate` prints them."""
        p = self.phases
        lines = [f"estimate ({self.loader} on {self.hardware}; model output): {p['total']:.1f} s = plan {p['plan']:.1f}"
                 f" + actors {p['actors']:.1f} + read {p['read']:.1f} + copy {p['copy']:.1f}",
                 f"{'node':>8} {'ranks':>5} {'backend':>11} {'storage s':>9} {'copies s':>8} {'exchange s':>10} "
                 f"{'to GPU s':>8} {'read s':>7} {'replica s':>9}  bound"]
        for n in self.nodes:
            lines.append(f"{n.node:>8} {len(n.ranks):>5} {n.backend:>11} {n.storage_s:9.2f} {n.copy_s:8.2f} "
                         f"{n.exchange_s:10.2f} {n.device_s:8.2f} {n.read_s:7.2f} {n.replica_s:9.2f}  "
                         f"{n.read_bound if n.read_s >= n.replica_s else n.replica_bound}")
        lines.append("critical path: " + " -> ".join(f"{ph} {s:.2f} s ({why})" for ph, s, why in self.critical_path))
        lines.append(f"bottleneck: {self.bottleneck}")
        return "\n".join(lines)


def _spread(per_rank: Sequence[int], rate: float, lanes: int) -> float:
    """Seconds for ranks moving `per_rank` bytes each at `rate` a lane, `lanes` lanes shared by all of them."""
    if not per_rank or not any(per_rank):
        return 0.0
    return max(max(per_rank) / rate, sum(per_rank) / (rate * max(1, min(lanes, len(per_rank)))))


def _storage_time(hw: Hardware, nbytes: int, requests: int, depth: int, readers: int) -> tuple[float, str]:
    """Seconds to read `nbytes` in `requests` with `depth` in flight, `readers` nodes sharing the storage's total, and
    which term bounds it."""
    st = hw.storage
    bandwidth = min(st.bandwidth_bps, st.total_bps / readers) if st.total_bps else st.bandwidth_bps
    costs = CostModel(request_s=st.latency_s, connection_bps=st.connection_bps, concurrency=max(1, depth),
                      part_bytes=st.request_bytes, bandwidth_bps=bandwidth)
    seconds = costs.seconds(requests, nbytes)
    if not nbytes:
        return 0.0, "nothing to read"
    if seconds <= nbytes / bandwidth * 1.0001:
        return seconds, f"storage bandwidth ({format_bytes(nbytes)} at {bandwidth / 1e9:.2f} GB/s)"
    if requests * st.latency_s >= nbytes / st.connection_bps:
        return seconds, f"storage latency ({requests:,} requests x {st.latency_s * 1e3:g} ms / {depth} in flight)"
    return seconds, f"storage streams ({depth} in flight x {st.connection_bps / 1e9:.2f} GB/s)"


def _hosts(fig: LoadFigures, hw: Hardware) -> list[tuple[NodeFigures, ...]]:
    """The nodes grouped by the machine they run on: each its own, or all one where they share a host."""
    return [fig.nodes] if hw.costs.shared_host else [(n,) for n in fig.nodes]


def predict(fig: LoadFigures, hardware: Hardware | dict | str) -> Estimate:
    """Seconds per phase, per node, the critical path and the bottleneck of a load moving `fig` on `hardware`."""
    hw = hardware_from(hardware)
    c, node = hw.costs, hw.node
    # a load copying a live replica takes that replica's plan: nothing is planned, nothing read from storage
    plan_s = (c.plan_s + fig.tensors * c.plan_tensor_s + c.plan_requests * fig.files * hw.storage.latency_s
              if fig.from_storage else 0.0)
    readers = sum(1 for n in fig.nodes if n.storage_bytes)
    times = []
    for host in _hosts(fig, hw):
        ranks = sum(len(n.ranks) for n in host)
        cores = node.cores
        actors = c.actor_start_s + c.actor_cpu_s * ranks / cores
        st_bytes, st_req = sum(n.storage_bytes for n in host), sum(n.requests for n in host)
        depth = min(hw.storage.connections, sum(n.depth for n in host))
        storage_s, storage_bound = _storage_time(hw, st_bytes, st_req, depth, readers if len(host) == 1 else 1)
        lanes = cores if fig.device == "cpu" else node.gpus
        copies = [b for n in host for b in n.copy_bytes]
        exchanged = [b for n in host for b in n.exchange_bytes]
        device = [b for n in host for b in n.device_bytes]
        copy_s = _spread(copies, node.memcpy_bps, cores)
        exchange_s = _spread(exchanged, node.gpu_link_bps, lanes)
        if exchange_s:
            exchange_s += max(n.rounds for n in host) * node.exchange_round_s
        device_s = _spread(device, node.host_to_device_bps, node.gpus)
        stages = {storage_bound: storage_s,
                  f"host memory copies ({format_bytes(sum(copies))} at {node.memcpy_bps / 1e9:.1f} GB/s a core)": copy_s,
                  f"the node's exchange ({format_bytes(max(exchanged, default=0))} a rank at "
                  f"{node.gpu_link_bps / 1e9:.1f} GB/s, {max(n.rounds for n in host):,} rounds)": exchange_s,
                  f"host to device ({format_bytes(max(device, default=0))} a GPU at "
                  f"{node.host_to_device_bps / 1e9:.1f} GB/s)": device_s}
        bound = max(stages, key=stages.get)
        reading = any(n.storage_bytes for n in host)
        read_s = (c.read_setup_s + stages[bound]) if reading else 0.0
        replica_s, replica_bound = _replica_time(host, hw)
        times += [NodeTime(n.node, n.ranks, n.backend, storage_s, storage_bound, copy_s, exchange_s, device_s, read_s,
                           bound, replica_s, replica_bound, actors) for n in host]
    return _estimate(fig, hw, plan_s, tuple(times))


def _replica_time(host: tuple[NodeFigures, ...], hw: Hardware) -> tuple[float, str]:
    """Seconds of a host's replica copies (bytes in and out over its NIC, within it over the GPU link or, on CPUs,
    through host memory), and what bounds them."""
    into, out = sum(n.replica_in for n in host), sum(n.replica_out for n in host)
    local = sum(n.replica_local for n in host)
    if not (into or out or local):
        return 0.0, "no replica copies"
    node = hw.node
    local_rate = node.gpu_link_bps if node.gpus else node.memcpy_bps
    parts = {f"the NIC ({format_bytes(max(into, out))} at {node.nic_bps / 1e9:.1f} GB/s)": max(into, out) / node.nic_bps,
             f"copies within the node ({format_bytes(local)} at {local_rate / 1e9:.1f} GB/s)": local / local_rate}
    bound = max(parts, key=parts.get)
    return hw.costs.copy_setup_s + parts[bound], bound


def _estimate(fig: LoadFigures, hw: Hardware, plan_s: float, times: tuple[NodeTime, ...]) -> Estimate:
    actors_s = max(t.actors_s for t in times)
    read = max(times, key=lambda t: t.read_s)
    copy = max(times, key=lambda t: t.replica_s)
    phases = {"plan": plan_s, "actors": max(0.0, actors_s - plan_s), "read": read.read_s, "copy": copy.replica_s}
    phases["total"] = sum(phases.values())
    first = ("actors", actors_s, "actors starting (planning runs meanwhile)") if actors_s >= plan_s else \
        ("plan", plan_s, f"planning {fig.tensors:,} tensors in {fig.files} files")
    path = [first]
    if fig.from_storage:
        path.append(("read", read.read_s, f"{read.node}: {read.read_bound}"))
    if copy.replica_s:
        path.append(("copy", copy.replica_s, f"{copy.node}: {copy.replica_bound}"))
    worst = max(path, key=lambda p: p[1])
    share = worst[1] / phases["total"] if phases["total"] else 0.0
    return Estimate(loader=fig.loader, hardware=hw.name or "hardware", phases=phases, nodes=times,
                    critical_path=tuple(path), bottleneck=f"{worst[2]}: {share:.0%} of the total",
                    assumptions=assumptions(hw))


def assumptions(hw: Hardware) -> tuple[str, ...]:
    """What every estimate on `hw` assumes: the model's own simplifications, then each figure and its source."""
    model = (
        "model output, not a measurement",
        "actors start while the driver plans; the read starts when both are done",
        "a node's storage reads, host copies, exchange and host-to-device copies are pipelined: the node reads at "
        "its slowest stage, plus each rank's read setup",
        "storage: each request waits the latency, then streams at one connection's rate; the requests in flight "
        "share the node's bandwidth, and the nodes reading at once share the storage's total",
        "replicas copy after replica 0 has read, over the NIC between nodes",
    ) + (("the nodes share one machine: its disk, page cache and cores",) if hw.costs.shared_host else ())
    figs = tuple(f"{k} = {v}" + (f" ({hw.source(k)})" if hw.source(k) else " (no source given)")
                 for k, v in hw.figures().items())
    return model + figs


def estimate(plan: Plan, hardware: Hardware | dict | str, *, loader: str = "raylazy", backend: str = "auto",
             node_ids: Sequence[str] | None = None, ranks_per_node: int | None = None,
             live_source: bool = False) -> Estimate:
    """The predicted seconds of `loader` loading `plan` on `hardware` (a `Hardware`, its mapping, or a preset's
    name): `figures`, then `predict`."""
    hw = hardware_from(hardware)
    return predict(figures(plan, hw, loader=loader, backend=backend, node_ids=node_ids, ranks_per_node=ranks_per_node,
                           live_source=live_source), hw)


def compare(plan: Plan, hardware: Hardware | dict | str, **kwargs) -> dict[str, Estimate]:
    """`estimate` of every loader (raylazy, naive, vLLM's default) on the same plan and hardware."""
    return {name: estimate(plan, hardware, loader=name, **kwargs) for name in LOADERS}
