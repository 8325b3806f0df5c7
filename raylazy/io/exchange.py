"""Cooperative reads through an exchange: one rank of a node reads its stripes of the node's schedule once,
moves each to its device, and sends every rank of the node exactly the bytes that rank keeps; every rank
scatters what it gets into its shards. The same code runs on CPUs over gloo and on GPUs over NCCL.

Order (deadlock-free): the stripes of each reader, in schedule order, form rounds: round t holds the t-th
stripe of every reader that has one. Every rank of the node runs the rounds in the same order and makes one
`Exchange.all_to_all` per round (skipped by all when nobody sends anything in it), sending to each peer the
pieces of its own stripe that peer keeps (replicated tensors: to every keeper) and receiving the pieces of the
other readers' stripes it keeps. Every rank derives every rank's sizes from the same schedule and keeps.

Memory (per rank, `ReaderOptions.staging_budget` bytes at most; `ConfigurationError` when it cannot be met):
    staging = depth * S + max over rounds of (D_t + sent_t + received_t)
where S is the rank's largest stripe, `depth` the staging buffers its readers fill ahead (pinned host memory
on CUDA), D_t the device copy of the round's stripe (S_t on CUDA, 0 on the CPU, where the staging buffer is
the stripe), and sent_t / received_t the packed bytes the rank sends / receives in round t. `depth` is the
largest that fits the budget, at most the rank's stripe count; at least 1 is needed. `ReadStats` reports
`staging_bytes` (that sum, as held: the buffers allocated plus the largest round's tensors) and
`staging_buffers` (depth).

Stripes are read with plain buffered positional reads (one request per stripe) through the storage
`Source`. O_DIRECT is not used: on files not in the page cache it read no faster than buffered reads, and it
needs aligned buffers and offsets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from contextvars import copy_context
from typing import NamedTuple

from ..core.options import ReaderOptions
from ..core.plans import NodeSchedule, RankPlan, Stripe
from ..core.schedule import Keep, NodeRead, rank_keeps
from ..errors import ConfigurationError
from ..storage import open_planned_files, reading
from .buffers import shard_buffers, shards_of
from .collective import Exchange, collective_backend
from .stats import Counter, Meter, Progress, ReadStats


class KeptRows(NamedTuple):
    """Where one keep's bytes are: `rows` rows of `length` bytes at stripe byte `src` (row pitch `src_stride`),
    landing at shard byte `dst` (pitch `dst_stride`)."""

    tensor: int
    src: int
    src_stride: int
    dst: int
    dst_stride: int
    rows: int
    length: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.length


def kept_rows(keep: Keep, stripe: Stripe) -> KeptRows:
    r, first, n = keep.part
    if r.count > 1:  # rows first .. first + n - 1 of a strided read
        return KeptRows(keep.tensor, r.offset + first * r.stride - stripe.start, r.stride,
                     r.dst_offset + first * r.dst_stride, r.dst_stride, n, r.length)
    return KeptRows(keep.tensor, r.offset + first - stripe.start, n, r.dst_offset + first, n, 1, n)


class NodeRounds:
    """The rounds of one node's schedule and what every local rank keeps of every stripe.

    `own[l]`: the stripes local rank l reads, in schedule order. `pieces[s][l]`: what local rank l keeps of
    stripe s, in its keeps' order. `sizes[s][l]`: their bytes."""

    def __init__(self, plans: tuple[RankPlan, ...], sched: NodeSchedule):
        self.sched = sched
        self.ranks = tuple(sched.ranks)
        local = {r: i for i, r in enumerate(self.ranks)}
        n = len(self.ranks)
        self.own: list[list[int]] = [[] for _ in range(n)]
        for s, st in enumerate(sched.stripes):
            self.own[local[st.reader]].append(s)
        self.pieces: list[list[list[KeptRows]]] = [[[] for _ in range(n)] for _ in sched.stripes]
        for rp in plans:
            for k in rank_keeps(rp, sched):
                self.pieces[k.stripe][local[rp.rank]].append(kept_rows(k, sched.stripes[k.stripe]))
        self.sizes = [[sum(p.nbytes for p in ps) for ps in per_rank] for per_rank in self.pieces]
        self.count = max((len(o) for o in self.own), default=0)
        #: Whether anyone sends anything in each round (else every rank skips its exchange).
        self.busy = [any(sum(self.sizes_of(l, t)[0]) for l in range(n)) for t in range(self.count)]

    def stripe(self, local: int, t: int) -> int | None:
        """The stripe local rank `local` reads in round t, if any."""
        own = self.own[local]
        return own[t] if t < len(own) else None

    def sizes_of(self, me: int, t: int) -> tuple[list[int], list[int]]:
        """(bytes local rank `me` sends to each local rank, bytes it receives from each) in round t."""
        mine = self.stripe(me, t)
        send = [self.sizes[mine][l] if mine is not None and l != me else 0 for l in range(len(self.ranks))]
        recv = [0 if l == me or self.stripe(l, t) is None else self.sizes[self.stripe(l, t)][me]
                for l in range(len(self.ranks))]
        return send, recv

    def staging(self, me: int, budget: int, on_device: bool) -> tuple[int, int, int]:
        """(depth, stripe buffer bytes S, the largest round's bytes) for local rank `me` under `budget`."""
        lengths = [self.sched.stripes[s].end - self.sched.stripes[s].start for s in self.own[me]]
        size = max(lengths, default=0)
        step = 0
        for t in range(self.count):
            send, recv = self.sizes_of(me, t)
            mine = self.stripe(me, t)
            device_copy = lengths[t] if on_device and mine is not None else 0
            step = max(step, device_copy + sum(send) + sum(recv))
        if not size:
            return 0, 0, step
        depth = min(len(lengths), (budget - step) // size)
        if depth < 1:
            raise ConfigurationError(
                f"staging_budget {budget} bytes is too small for rank {self.ranks[me]}: its stripes take up to {size} "
                f"bytes and its largest exchange round {step} more, so it needs at least {size + step}: raise "
                "staging_budget or make stripes smaller")
        return depth, size, step


def read_rank_exchanged(
    plan: RankPlan,
    device: str = "cpu",
    *,
    node_read: NodeRead,
    options: ReaderOptions = ReaderOptions(),
    on_progress: Progress | None = None,
    out: Mapping | None = None,
    sources: Mapping | None = None,
    exchange: Exchange | None = None,
) -> tuple[dict, ReadStats]:
    """Load `plan`'s shards on `device` cooperatively with the other ranks of its node (`node_read`, with the plans
    of all of them: `raylazy.io.nodes.node_read`); returns ({name: tensor}, stats). Every rank of the node must
    call it with the same `node_read` at about the same time, each in its own process.

    The exchange runs over gloo for device "cpu" and NCCL for CUDA devices. `options`: `threads` threads
    read stripes; staging stays within `staging_budget` bytes; a peer that does not answer for
    `stripe_timeout_s` fails the exchange. A failure on any rank fails every rank of the node
    (PeerFailedError on the others); no partial shard is returned. `out` and `sources` as for the other readers
    (`raylazy.io.ranged.read_rank_ranged`). `exchange`: the node's Exchange, open already (its local ranks in
    `schedule.ranks` order) and left open, for a caller reading several plans in turn (the vLLM loader's
    batches); without it, the ranks meet at `node_read.address` for this read.
    """
    import torch

    sched = node_read.schedule
    if plan.rank not in sched.ranks or tuple(p.rank for p in node_read.plans) != tuple(sched.ranks):
        raise ConfigurationError(f"rank {plan.rank}: node {sched.node!r} has ranks {list(sched.ranks)} and plans for "
                                 f"{[p.rank for p in node_read.plans]}: give the node's plans in its ranks' order "
                                 "(raylazy.io.nodes.node_read)")
    dev = torch.device(device)
    stats, counter, meter = ReadStats(backend="exchange", device=str(dev)), Counter(on_progress), Meter()
    rounds = NodeRounds(node_read.plans, sched)
    me = sched.ranks.index(plan.rank)
    depth, size, _ = rounds.staging(me, options.staging_budget, dev.type != "cpu")
    buffers = shard_buffers(torch, plan, dev, out)
    steps = _RankRounds(torch, rounds, me, [flat for flat, _ in buffers], dev, stats, counter)
    files = sorted({sched.stripes[s].file for s in rounds.own[me]})
    group = collective_backend(device), me, len(sched.ranks), node_read.address, options.stripe_timeout_s, str(dev)
    with open_planned_files(plan, files, options.storage_options, sources) as sources, \
            (nullcontext(exchange) if exchange else Exchange(*group)) as ex, \
            _StripeReader(torch, options.threads, sources, sched.stripes, rounds.own[me], depth, size,
                          dev.type != "cpu") as reader:
        for t in range(rounds.count):
            steps.run(t, reader, ex)
        if dev.type != "cpu":
            torch.cuda.synchronize(dev)
    stats.staging_buffers, stats.staging_bytes = depth, depth * size + steps.peak
    stats.in_flight, stats.request_bytes = min(options.threads, depth), size
    stats.bytes_needed = counter.value
    meter.stop(stats)
    return shards_of(plan, buffers), stats


class _RankRounds:
    """One rank's side of every round: read its stripe (and move it to the device), place its own keeps, pack and
    send what the others keep, place what it receives. `peak`: the most bytes one round held beside the staging
    buffers (the device copy, sends, receives)."""

    def __init__(self, torch, rounds: NodeRounds, me: int, flats: list, dev, stats: ReadStats, counter: Counter):
        self.torch, self.rounds, self.me, self.flats, self.dev = torch, rounds, me, flats, dev
        self.stats, self.counter, self.peak = stats, counter, 0

    def run(self, t: int, reader: _StripeReader, ex: Exchange) -> None:
        s = self.rounds.stripe(self.me, t)
        data, event, held = self._read_own(s, reader) if s is not None else (None, None, 0)
        if self.rounds.busy[t]:
            held += self._exchange(ex, t, s, data)
        if s is not None:
            reader.release(event)
        self.peak = max(self.peak, held)

    def _read_own(self, s: int, reader: _StripeReader) -> tuple:
        """This rank's stripe `s` (on the device), its own keeps placed: (the stripe, its copy's event, bytes held)."""
        data, event, held = reader.next(), None, 0
        self.stats.requests += 1
        self.stats.bytes_read += data.numel()
        if self.dev.type != "cpu":  # from the pinned buffer, which is refilled once this copy is done
            data = data.to(self.dev, non_blocking=True)
            event = self.torch.cuda.Event()
            event.record()
            held = data.numel()
        self.counter.add(_place(self.rounds.pieces[s][self.me], data, self.flats))
        return data, event, held

    def _exchange(self, ex: Exchange, t: int, s: int | None, data) -> int:
        """Round t's all-to-all: what the others keep of this rank's stripe out, what it keeps of theirs in and
        placed; returns the bytes of the send and receive buffers."""
        torch, rounds, me = self.torch, self.rounds, self.me
        send_sizes, recv_sizes = rounds.sizes_of(me, t)
        send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=self.dev)
        o = 0
        for l, pieces in enumerate(rounds.pieces[s] if s is not None else ()):
            o = o if l == me else _pack(pieces, data, send, o)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=self.dev)
        ex.all_to_all(recv, send, recv_sizes, send_sizes, what=f"round {t + 1} of {rounds.count}")
        o = 0
        for l, n in enumerate(recv_sizes):
            if n:
                self.counter.add(_place(rounds.pieces[rounds.stripe(l, t)][me], recv, self.flats, packed=o))
                o += n
        self.stats.bytes_received += o
        return send.numel() + recv.numel()


def _rows(flat, offset: int, stride: int, rows: int, length: int):
    """`rows` rows of `length` bytes of the flat uint8 tensor `flat`, from byte `offset`, `stride` bytes apart."""
    return flat.as_strided((rows, length), (stride, 1), flat.storage_offset() + offset)


def _pack(pieces: list[KeptRows], stripe, send, o: int) -> int:
    """Copy `pieces` out of `stripe` into `send`, back to back from byte `o`; returns the end."""
    for p in pieces:
        _rows(send, o, p.length, p.rows, p.length).copy_(_rows(stripe, p.src, p.src_stride, p.rows, p.length))
        o += p.nbytes
    return o


def _place(pieces: list[KeptRows], data, flats, packed: int | None = None) -> int:
    """Copy `pieces` into the shards `flats`: from their places in stripe `data`, or (`packed`) from `data`
    back to back from byte `packed`, as `_pack` left them. Returns the bytes placed."""
    o = packed
    for p in pieces:
        src = _rows(data, p.src, p.src_stride, p.rows, p.length) if o is None else _rows(data, o, p.length, p.rows, p.length)
        _rows(flats[p.tensor], p.dst, p.dst_stride, p.rows, p.length).copy_(src)
        o = None if o is None else o + p.nbytes
    return sum(p.nbytes for p in pieces)


class _StripeReader:
    """Reads one rank's stripes, in order, into `depth` reusable buffers of `size` bytes (pinned for a GPU),
    on `threads` threads, as far ahead of the consumer as free buffers allow. Leaving it on an exception
    drops the reads not yet started."""

    def __init__(self, torch, threads: int, sources, stripes, own: list[int], depth: int, size: int, pinned: bool):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raylazy-stripe")
        self.sources, self.stripes = sources, stripes
        self.free = deque(torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(depth))
        self.todo = deque(own)
        self.ahead: deque = deque()  # (future, buffer) in stripe order
        self._submit()

    def __enter__(self) -> _StripeReader:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=exc_type is not None)

    def next(self):
        """The next stripe's bytes (a view of its buffer); its buffer is in use until `release`."""
        return self.ahead[0][0].result()

    def release(self, event=None) -> None:
        """The consumer is done with the oldest stripe (once `event`, its device copy, completes)."""
        if event is not None:
            event.synchronize()
        self.free.append(self.ahead.popleft()[1])
        self._submit()

    def _submit(self) -> None:
        while self.free and self.todo:
            buf = self.free.popleft()
            self.ahead.append((self.pool.submit(copy_context().run, self._read, self.todo.popleft(), buf), buf))

    def _read(self, s: int, buf):
        st = self.stripes[s]
        source = self.sources[st.file]
        n = min(st.end, source.size) - st.start
        with reading(source, f"reading stripe {s} (bytes {st.start}-{st.start + n})"):
            source.readinto(st.start, [memoryview(buf.numpy()).cast("B")[:n]])
        return buf[:n]
