"""Cooperative reads (raylazy.io.cooperative): a node's ranks, as separate processes, read each stripe once and
every rank gets its shards bit for bit as safetensors' get_tensor + the slice vLLM gives it; through raylazy.load
on one node and on two; changed files, dead readers and caller buffers.

What a node reads is measured in its ranks' processes (tests/support/measured.py): the file ranges their read and populate
system calls covered, and their read_bytes from a cold page cache. Simulated nodes share this machine's page
cache, so the tests that tell two nodes apart run each node alone, from a cold cache."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import raylazy
from raylazy.core.options import ReaderOptions
from raylazy.core.plans import Stripe
from raylazy.core.schedule import request_runs, with_node_schedules
from raylazy.errors import ConfigurationError, FileChangedError, RankFailedError, ReadError
from raylazy.io import mapping, shared
from raylazy.io.cooperative import read_rank_cooperative
from raylazy.io.nodes import node_read, node_reads
from raylazy.io.shared import FAILED, READY, ReadyMap, shm_dir
from raylazy.io.stats import io_delta, proc_io
from raylazy.planning import make_plan
from tests.support import RANK_PROCESSES
from tests.support.measured import (
    PAGE,
    SyscallLog,
    assert_header_checks_only,
    cold,
    header_bytes,
    needed_pages,
    pages,
)
from tests.support.planlib import as_bytes, read_ranges
from tests.support.raytest import check_loaded, check_ranks


def _rank(rp, task, options, queue, die: bool, use_out: bool, populate: bool) -> None:
    if die:  # a reader whose process dies before reading anything
        os._exit(3)
    try:
        if not populate:  # as before Linux 5.14
            import raylazy.io.mapping as mapping

            mapping._POPULATE = 0
        out = {}
        if use_out:
            from raylazy.io.buffers import shard_layout

            out = {t.name: torch.empty(shard_layout(t)[1], dtype=shard_layout(t)[0]) for t in rp.tensors}
        log, reserve, staged = SyscallLog().install(), ReadyMap.reserve, []
        ReadyMap.reserve = lambda ready, s: staged.append(s.end - s.start) or reserve(ready, s)
        before = proc_io()
        shards, stats = read_rank_cooperative(rp, "cpu", node_read=task, options=options, out=out or None)
        seen = {"io": io_delta(before, proc_io()), "preadv": log.preadv, "pread": log.pread, "populated": log.populated,
                "staged": sum(staged)}
        same = all(shards[n] is out[n] for n in out)
        sent = {n: (t.dtype, tuple(t.shape), as_bytes(t)) for n, t in shards.items()}  # plain bytes: no fd passing
        queue.put((rp.rank, (sent, stats, same, seen)))
    except BaseException as e:  # noqa: BLE001  (sent to the test)
        queue.put((rp.rank, e))


#: Stripe readers (`ReaderOptions.stripe_readers`), for the tests of the ready map and its readers.
READERS = ReaderOptions(stripe_readers=4, stripe_timeout_s=60)


def run_nodes(plan, options=ReaderOptions(), die=(), use_out=False, timeout=120, ranks=None, populate=True,
              staged=False) -> dict:
    """Run every rank of every scheduled node of `plan` (or only `ranks`) as its own process, all at once;
    rank -> (shards, stats, same, seen: what its process was measured reading) or error. `populate=False`: the
    readers cannot MADV_POPULATE_READ. `staged`: the node's bytes read into stages in shared memory, as on storage
    with no page cache to share."""
    queue, load_id = RANK_PROCESSES.Queue(), f"test{os.getpid()}x{time.monotonic_ns()}"
    reads = {n.node: replace(node_read("cooperative", plan, n, load_id), staged=staged) for n in plan.nodes}
    procs = [RANK_PROCESSES.Process(target=_rank, args=(rp, reads[plan.node_of(rp.rank).node], options, queue,
                                                        rp.rank in die, use_out, populate))
             for rp in plan.ranks if ranks is None or rp.rank in ranks]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs) - len(die):
        results.update([queue.get(timeout=max(1, deadline - time.monotonic()))])
    for p in procs:
        p.join(10)
    for r, v in results.items():
        if not isinstance(v, BaseException):
            shards = {n: torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dt).reshape(shape) if b else
                      torch.empty(shape, dtype=dt) for n, (dt, shape, b) in v[0].items()}
            results[r] = (shards, *v[1:])
    left = [n for n in os.listdir(shm_dir()) if n.startswith(f"raylazy-{load_id}")]
    # the node's ranks remove its ready map; a rank that died never counts itself done: that is what a crash leaves
    assert bool(left) == bool(die), left
    for n in left:
        os.unlink(os.path.join(shm_dir(), n))
    return results


def run_each_node_cold(plan, options, populate=True) -> dict:
    """`run_nodes` for one node of `plan` at a time, each from a cold page cache, checking what each node read
    (`check_node_reads`). A warm run goes first: a rank's process faults in the pages of the code it runs (torch's
    and numpy's libraries, raylazy's modules) where no process has yet, and read_bytes would count them."""
    results = {}
    files = [f.uri for f in plan.files]
    _ok(run_nodes(plan, options, ranks=plan.nodes[0].ranks, populate=populate))
    for node in plan.nodes:
        warm = cold(files)
        if warm:
            warnings.warn(f"{warm}: the nodes' reads from storage are not measured", stacklevel=2)
        results.update(_ok(run_nodes(plan, options, ranks=node.ranks, populate=populate)))
        check_node_reads(plan, node, results, options.stripe_readers, warm is None)
    return results


def check_node_reads(plan, node, results: dict, readers: int, was_cold: bool) -> None:
    """What `node`'s rank processes read, measured. Stripe readers: their populate calls (or, before Linux 5.14, their
    positional reads) cover every page of the node's union once and nothing else, one call per request (a stripe,
    or a run of adjacent ones: `request_runs`), and the ranks' statistics say as much. Without stripe readers no
    rank reads data through system calls (only the header checks): the kernel reads on the ranks' page faults, and
    the page cache makes that once per page. From a cold cache the ranks made storage deliver every page of the
    union, and at most the files' pages (the kernel's read-around reads beyond the union; for these tiny files, all
    of them)."""
    seen = [results[r][3] for r in node.ranks]
    stats = [results[r][1] for r in node.ranks]
    union = needed_pages(plan, node.ranks)
    calls = [c for s in seen for c in s["populated"] + s["preadv"]]
    assert_header_checks_only([c for s in seen for c in s["pread"]], plan)
    if readers:
        assert Counter(pages(calls)) == Counter(union), f"node {node.node}: its readers' calls are not its union once"
        assert len(calls) == sum(len(request_runs(node, r)) for r in node.ranks) == sum(s.requests for s in stats)
        assert sum(end - start for _, start, end in calls) == sum(s.bytes_read for s in stats)
    else:  # no stripe readers: the statistics' share of the union is bookkeeping, not a read
        assert not calls and sum(s.requests for s in stats) == 0, f"node {node.node}: data read by system calls"
    if was_cold:
        pulled = sum(s["io"]["read_bytes"] for s in seen)
        files = {plan.files[st.file].uri for st in node.stripes}
        # read_bytes is the whole process's: a page or two of code a rank touches first here count as well
        slack = 16 * PAGE
        assert len(union) * PAGE * 0.98 <= pulled <= sum(-(-os.path.getsize(f) // PAGE) * PAGE for f in files) + slack, (
            f"node {node.node} pulled {pulled} bytes from storage for a union of {len(union)} pages")


def _ok(results: dict) -> dict:
    bad = {r: v for r, v in results.items() if isinstance(v, BaseException)}
    assert not bad, bad
    return results


@pytest.mark.parametrize("readers", (0, 4))
@pytest.mark.parametrize("tp", (2, 4, 8))
def test_one_and_two_nodes_bit_for_bit_and_each_node_reads_its_union_once(model_dir, tp, readers):
    """Bit for bit on one node and on two; each node, run alone from a cold cache, reads its union once
    (`check_node_reads`)."""
    plan = make_plan(model_dir, tp)
    for node_ids in (["n"] * tp, ["a", "b"] * (tp // 2)):
        scheduled = with_node_schedules(plan, node_ids, stripe_bytes=8192)
        results = run_each_node_cold(scheduled, ReaderOptions(stripe_readers=readers, stripe_timeout_s=60))
        check_ranks(scheduled, [results[r][0] for r in range(tp)], model_dir)
        for node in scheduled.nodes:
            assert all(results[r][1].backend == "cooperative" for r in node.ranks)
            if readers:
                assert all(results[r][3]["populated"] for r in node.ranks if node.read_by(r)), "populated, not read"


def test_readers_without_populate_read_into_scratch(llama_dir):
    """Before Linux 5.14 (no MADV_POPULATE_READ) readers read each stripe into a scratch buffer with positional reads:
    the same shards, the union read once (`check_node_reads`), and the scratch is the staging reported."""
    plan = with_node_schedules(make_plan(llama_dir, 4), ["n"] * 4, stripe_bytes=8192)
    results = run_each_node_cold(plan, READERS, populate=False)
    check_ranks(plan, [results[r][0] for r in range(4)], llama_dir)
    assert not any(results[r][3]["populated"] for r in range(4))
    readers = [results[r][1] for r in range(4) if results[r][3]["preadv"]]
    assert readers and all(0 < s.staging_bytes <= READERS.stripe_readers * 8192 for s in readers)


#: A hardware memory error met populating (Linux's EHWPOISON; Python's errno module lacks the name).
EHWPOISON = 133


@pytest.mark.parametrize("err", (errno.EINVAL, errno.EFAULT, EHWPOISON), ids=("unsupported", "failed", "poisoned"))
def test_only_a_kernel_without_populate_makes_readers_read_into_scratch(tmp_path, monkeypatch, err):
    """madvise(MADV_POPULATE_READ) refused with EINVAL (a kernel before 5.14): `populate` says so, and the process
    reads into scratch from then on. Any other error (EFAULT: the storage failed a page; EHWPOISON) is raised,
    not read around."""
    path = tmp_path / "file"
    path.write_bytes(os.urandom(2 * mmap.PAGESIZE))
    calls = []

    def madvise(address, length, advice):
        calls.append(advice)
        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(mapping, "_POPULATE", mapping._POPULATE or 22)  # put back after the test
    monkeypatch.setattr(mapping, "_libc", SimpleNamespace(madvise=madvise))
    maps = {}
    with open(path, "rb") as f:
        stripe = SimpleNamespace(file=0, start=0, end=mmap.PAGESIZE)
        if err == errno.EINVAL:
            assert mapping.populate(SimpleNamespace(fd=f.fileno()), stripe, maps) is False
            assert mapping._POPULATE == 0 and not mapping.populates()
        else:
            with pytest.raises(OSError) as e:
                mapping.populate(SimpleNamespace(fd=f.fileno()), stripe, maps)
            assert e.value.errno == err and mapping._POPULATE
        maps.clear()
    assert len(calls) == 1


@pytest.mark.parametrize("options", (ReaderOptions(), READERS), ids=("kernel", "readers"))
def test_out_buffers_are_filled_in_place(llama_dir, options):
    plan = with_node_schedules(make_plan(llama_dir, 4), ["n"] * 4, stripe_bytes=8192)
    results = _ok(run_nodes(plan, options, use_out=True))
    assert all(results[r][2] for r in range(4))
    check_ranks(plan, [results[r][0] for r in range(4)], llama_dir)


@pytest.mark.parametrize("options", (ReaderOptions(), READERS), ids=("kernel", "readers"))
def test_file_changed_after_planning(llama_dir, tmp_path, options):
    d = str(shutil.copytree(llama_dir, tmp_path / "llama"))
    plan = with_node_schedules(make_plan(d, 2), ["n"] * 2, stripe_bytes=8192)
    with open(plan.files[0].uri, "ab") as f:
        f.write(b"\0")
    results = run_nodes(plan, options)
    assert all(isinstance(e, FileChangedError) for e in results.values()), results
    assert plan.files[0].uri in str(results[0]) and "plan again" in str(results[0])


@pytest.mark.parametrize("direct", (False, True), ids=("all-staged", "direct"))
@pytest.mark.parametrize("nodes", (1, 2))
def test_staged_reads_fetch_the_union_once_into_shared_memory(llama_dir, nodes, direct):
    """Staged (storage with no page cache to share: object storage, a direct_io mount): each node's readers read
    every stripe of its union once, with one positional read into its stage, and every rank copies its bytes out of
    the stages, bit for bit; nothing is left in shared memory (`run_nodes` checks). A direct stripe (bytes one rank
    alone keeps) is read into that rank's shard and never staged."""
    plan = with_node_schedules(make_plan(llama_dir, 4), ["a", "b"] * 2 if nodes == 2 else ["n"] * 4, stripe_bytes=8192,
                               direct=direct)
    results = _ok(run_nodes(plan, ReaderOptions(threads=3), staged=True))
    check_ranks(plan, [results[r][0] for r in range(4)], llama_dir)
    for node in plan.nodes:
        check_node_reads(plan, node, results, readers=3, was_cold=False)
        assert not any(results[r][3]["populated"] for r in node.ranks)
        assert bool(node.direct) == direct
        assert sum(results[r][3]["staged"] for r in node.ranks) == node.staged_bytes == node.nbytes - sum(
            node.stripes[i].end - node.stripes[i].start for i in node.direct)
        assert all(results[r][1].backend == "cooperative" and results[r][1].staging_bytes == 0 for r in node.ranks)
        for r in node.ranks:  # the bytes of its reads inside stripes its node's other ranks read
            others = [s for s in node.stripes if s.reader != r]
            received = sum(max(0, min(off + n, s.end) - max(off, s.start)) for t in plan.ranks[r].tensors
                           for x in t.reads for off, _, n in read_ranges(x) for s in others if s.file == x.file)
            assert results[r][1].bytes_received == received, r


def test_stages_live_in_shared_memory_and_give_it_back(llama_dir, monkeypatch):
    """A file's stage is a sparse file of its size, named only until every rank of the node opened it (then nothing
    is left behind by a rank killed); a stripe's room is allocated before its reader writes (a write through a
    mapping into a full tmpfs would be a SIGBUS) and given back once every rank is done with it. Where shared memory
    lacks room for the node's bytes, the stages go to the temporary directory; where neither has room, the error
    says where, how much and what to do."""
    plan = with_node_schedules(make_plan(llama_dir, 1), ["n"], stripe_bytes=8192)
    sched, rp = plan.nodes[0], plan.ranks[0]
    s = sched.stripes[0]
    ready = ReadyMap(f"test{os.getpid()}x{time.monotonic_ns()}", sched, staged=True)
    try:
        stages = ready.stage(rp)
        assert os.path.dirname(ready._stage_path(s.file)) == shm_dir()
        assert not os.path.exists(ready._stage_path(s.file))  # its one rank opened it: unnamed
        fd = ready.stages[s.file]
        assert os.fstat(fd).st_size == plan.files[s.file].size and os.fstat(fd).st_blocks == 0
        room = ready.reserve(s)
        room[:] = 7
        assert os.fstat(fd).st_blocks * 512 >= s.end - s.start
        assert bool((stages[s.file][s.start : s.end] == 7).all())
        ready.release([0])
        if shm_dir() == "/dev/shm":  # tmpfs: the memory is given back
            assert os.fstat(fd).st_blocks == 0
            u = next(x for x in sched.stripes if x.file == s.file and (x.end & x.start) > x.end - x.start)
            ready.reserve(u)  # its room allocated and its page tables filled ahead: not a page more
            assert os.fstat(fd).st_blocks * 512 == u.end - u.start
        monkeypatch.setattr(shared.os, "posix_fallocate", _no_room)
        monkeypatch.setattr(shared.os, "statvfs", lambda path: SimpleNamespace(f_bavail=3, f_frsize=4096))
        with pytest.raises(ConfigurationError, match=r"no room to stage .*backend='exchange'") as err:
            ready.reserve(sched.stripes[1])
        monkeypatch.undo()
        t = sched.stripes[1]
        union = sum(x.end - x.start for x in sched.stripes)
        assert f"bytes {t.start}-{t.end} of file {t.file}" in str(err.value) and f"{union} bytes in all" in str(err.value)
        assert "12288 free" in str(err.value)
    finally:
        ready.done()
    assert not os.path.exists(ready.path)
    union = sum(x.end - x.start for x in sched.stripes)
    for free, folder in ((union, shm_dir()), (union - 1, tempfile.gettempdir())):  # room for the node's bytes, or not
        monkeypatch.setattr(shared.os, "statvfs", lambda path, free=free: SimpleNamespace(f_bavail=free, f_frsize=1))
        ready = ReadyMap(f"test{os.getpid()}x{time.monotonic_ns()}", sched, staged=True)
        try:
            assert os.path.dirname(ready._stage_path(s.file)) == folder
        finally:
            ready.done()


def _no_room(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_node_read_leaves_no_ready_map_or_stage_behind(llama_dir):
    """A reader that fails marks its stripes not yet ready as failed (its keepers stop waiting for them), a ready
    one stays ready. The last of a node's ranks to finish removes the ready map, and the stages' names where a
    rank failed before it opened them (a second rank opens a map of any size: past 256 bytes, Python's ints are
    not shared objects); where a rank's process died, the driver's `remove_ready_maps` removes the load's files and
    no other load's."""
    sched = with_node_schedules(make_plan(llama_dir, 2), ["n"] * 2, stripe_bytes=8192).nodes[0]
    rp = make_plan(llama_dir, 2).ranks[0]
    load = f"test{os.getpid()}x{time.monotonic_ns()}"
    first = ReadyMap(load, sched, staged=True)
    first.stage(rp)  # one of two ranks opened the stages: their names stay
    stages = {first._stage_path(f) for f in first.stages}
    assert stages and all(os.path.exists(p) for p in stages)
    second = ReadyMap(load, sched, staged=True)  # a rank that fails before it opens the stages
    second.mark(0)
    second.fail([0, 1, 2])
    assert list(first.flags[:3]) == [READY, FAILED, FAILED]
    first.done()
    assert os.path.exists(first.path)
    second.done()
    assert not os.path.exists(first.path) and not any(os.path.exists(p) for p in stages)
    many = sched.model_copy(update={"stripes": tuple(Stripe(0, i << 12, (i + 1) << 12, 0) for i in range(100))})
    maps = [ReadyMap(f"{load}z", many) for _ in many.ranks]  # a map of 332 bytes, opened by a second rank
    for m in maps:
        m.done()
    assert not os.path.exists(maps[0].path)

    other = ReadyMap(f"{load}y", sched, staged=True)
    try:
        dead = ReadyMap(load, sched, staged=True)
        dead.stage(rp)  # a rank killed here would leave the ready map and the stages named
        left = [dead.path, *(dead._stage_path(f) for f in dead.stages)]
        shared.remove_ready_maps(load)
        assert not any(os.path.exists(p) for p in left) and os.path.exists(other.path)
        dead.done()
    finally:
        other.done()  # one of its two ranks: its file stays, for this test to remove
        shared.remove_ready_maps(f"{load}y")


def test_only_exchanging_nodes_are_asked_where_they_meet_and_only_nodes_with_no_page_cache_stage(llama_dir):
    """`node_reads` asks where the nodes meet once, for the exchanging nodes only (their first ranks), and each
    rank's node read carries its node's address; a cooperative node stages its bytes only where its files share no
    page cache (object storage here)."""
    plan = make_plan(llama_dir, 4)
    asked = []

    def meet(ranks):
        asked.append(ranks)
        return [f"at{r}" for r in ranks]

    nodes, cpus = ["a", "a", "b", "b"], ["cpu"] * 4
    _, reads = node_reads(plan, nodes, cpus, ReaderOptions(), "load", meet)
    assert asked == [] and [(r.reader.backend, r.node_read.address) for r in reads] == [("cooperative", "")] * 4
    _, reads = node_reads(plan, nodes, cpus, ReaderOptions(backend="exchange"), "load", meet)
    assert asked == [[0, 2]] and [r.node_read.address for r in reads] == ["at0", "at0", "at2", "at2"]

    local = with_node_schedules(make_plan(llama_dir, 2), ["n"] * 2)
    s3 = local.model_copy(update={"files": tuple(f.model_copy(update={"uri": f"s3://bucket/{os.path.basename(f.uri)}"})
                                                 for f in local.files)})
    assert [node_read(b, p, p.nodes[0], "load").staged for b in ("cooperative", "exchange") for p in (local, s3)] == [
        False, True, False, False]
    # staged, a rank fetches the bytes it alone keeps straight into its shards: direct stripes, there only
    direct = {(name, backend): bool(p.nodes[0].direct) for name, plan in (("local", local), ("s3", s3))
              for backend in ("cooperative", "exchange")
              for p, _ in [node_reads(plan, ["n"] * 2, ["cpu"] * 2, ReaderOptions(backend=backend), "load", meet)]}
    assert direct == {("local", "cooperative"): False, ("s3", "cooperative"): True, ("local", "exchange"): False,
                      ("s3", "exchange"): False}


def test_dead_reader_fails_its_keepers_with_a_clear_error(llama_dir):
    plan = with_node_schedules(make_plan(llama_dir, 2), ["n"] * 2, stripe_bytes=8192)
    t0 = time.monotonic()
    results = run_nodes(plan, ReaderOptions(stripe_readers=4, stripe_timeout_s=2), die={1})
    err = results[0]
    assert isinstance(err, ReadError), err
    assert "rank 1" in str(err) and "not ready within 2 s" in str(err) and ".safetensors" in str(err)
    assert time.monotonic() - t0 < 60


# --- through raylazy.load ---------------------------------------------------------------------------


def check_copied_from_mappings(loaded) -> None:
    """Each rank's read calls (rchar, measured in its process) returned its header checks and little else: its
    shards were copied out of mappings of the page cache, not read. Which node pulled which page from storage
    cannot be told apart here (the simulated nodes and earlier tests share one page cache): `run_each_node_cold`
    measures that, without Ray."""
    for rp, s in zip(loaded.plan.ranks, loaded.stats):
        headers = sum(header_bytes(loaded.plan.files[f].uri) for f in {r.file for t in rp.tensors for r in t.reads})
        assert headers <= s.rchar < headers + s.bytes_needed // 4, (rp.rank, s.rchar, headers, s.bytes_needed)


@pytest.mark.ray
@pytest.mark.parametrize("tp", (2, 4))
def test_load_defaults_to_cooperative_on_a_shared_node(llama_dir, ray_local, tp):
    with raylazy.load(llama_dir, tp, device="cpu", progress=False, stripe_bytes=8192) as loaded:
        assert {s.backend for s in loaded.stats} == {"cooperative"}
        (node,) = loaded.plan.nodes
        assert node.ranks == tuple(range(tp)) and node.node == loaded.ranks[0].node_id
        check_copied_from_mappings(loaded)
        check_loaded(loaded, llama_dir)


def dying_reader(marker: str) -> type:
    """A RankLoader class whose rank 1 process dies on its first load (writing `marker`); its restart loads normally.
    (Defined in a function so that Ray ships the class by value.)"""

    class DyingReader(raylazy.cluster.actor.RankLoader):
        def load(self, plan, options, node_read=None):
            if self.info().rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
            return super().load(plan, options, node_read)

    return DyingReader


@pytest.mark.ray
@pytest.mark.parametrize("readers", (0, 4))
@pytest.mark.parametrize("retries", (0, 2))
def test_dead_reader_is_restarted_or_fails_the_load_once(llama_dir, ray_local, tmp_path, retries, readers):
    marker = str(tmp_path / "died")
    cls = dying_reader(marker)
    t0 = time.monotonic()
    if retries:
        with raylazy.load(llama_dir, 2, device="cpu", progress=False, actor_cls=cls, max_retries=retries,
                          stripe_bytes=8192, stripe_readers=readers) as loaded:
            assert os.path.exists(marker)
            check_loaded(loaded, llama_dir)
    else:
        maps = lambda: {n for n in os.listdir(shm_dir()) if n.startswith("raylazy-") and n.endswith(".ready")}  # noqa: E731
        before = maps()
        with pytest.raises(RankFailedError) as info:
            raylazy.load(llama_dir, 2, device="cpu", progress=False, actor_cls=cls, max_retries=0,
                         stripe_timeout_s=20, stripe_readers=readers)
        assert 1 in info.value.failures and os.path.exists(marker)
        assert maps() == before  # the surviving rank removed the node's ready map the dead one left
    assert time.monotonic() - t0 < 120


@pytest.mark.ray
def test_two_nodes_read_on_their_own_schedules(two_node_cluster, llama_dir):
    """Each rank on its node's schedule, copying from mappings (`check_copied_from_mappings`); bit for bit."""
    with raylazy.load(llama_dir, 4, use_gpu=True, device="cpu", progress=False, placement_timeout_s=120,
                      stripe_bytes=8192) as loaded:
        nodes = {n.node: n for n in loaded.plan.nodes}
        assert len(nodes) == 2
        for info, s in zip(loaded.ranks, loaded.stats):
            assert info.rank in nodes[info.node_id].ranks and s.backend == "cooperative"
        check_copied_from_mappings(loaded)
        check_loaded(loaded, llama_dir)


@contextmanager
def _evicted_mapping(tmp_path, size: int):
    """A file of `size` random bytes, out of the page cache (posix_fadvise DONTNEED; the test skips where the
    file system keeps them), mapped as the vLLM format maps a checkpoint file (`mapped`). On leaving, the
    mapping still holds the file's bytes."""
    from benchmarks.loaders.pagecache import evict
    from raylazy.io.mapping import mapped
    from raylazy.storage.local import LocalSource

    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        os.fsync(f.fileno())
    if evict([str(path)]):
        pytest.skip("this file system keeps the file's pages after posix_fadvise(DONTNEED)")
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mapped(LocalSource(str(path), fd, size))
        yield m, path
        assert torch.equal(m, torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))
    finally:
        m = None
        os.close(fd)


def test_populating_brings_in_what_the_page_cache_lacks_and_leaves_what_it_holds(tmp_path, monkeypatch):
    """A consumer copying out of a mapping (the vLLM format) has threads populate it ahead only where the kernel's
    page cache lacks pages: evicted (posix_fadvise DONTNEED), the span is read into it; read already, no thread
    starts (it would take the copies' core for nothing)."""
    from benchmarks.loaders.pagecache import resident_bytes
    from raylazy.io.mapping import in_page_cache, populating

    started = []  # the threads' names as they start (a populate may be over before a look at the live ones)
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or start(self))
    with _evicted_mapping(tmp_path, 64 << 20) as (m, path):
        half, tail = 4 << 20, 32 << 20  # the tail: past any read-ahead of the first 4 MB
        assert not in_page_cache(m.data_ptr(), 64 << 20)
        with populating([(m, 0, half)], threads=2, chunk_bytes=1 << 20):
            assert "raylazy-populate" in started
            deadline = time.monotonic() + 30
            while not in_page_cache(m.data_ptr(), half) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert in_page_cache(m.data_ptr(), half) and not in_page_cache(m.data_ptr() + tail, tail)
        assert half <= resident_bytes(str(path)) <= tail  # the benchmark's own count of the file's resident pages
        started.clear()
        with populating([(m, 0, half)], threads=2, chunk_bytes=1 << 20):
            assert "raylazy-populate" not in started


def test_the_cached_share_is_a_sample_of_what_the_page_cache_holds(tmp_path, monkeypatch):
    """`cached_share` (whether the vLLM format finds a checkpoint in the page cache) samples a page every 2 MiB,
    at most `most` of them and the last (counted: its mincore calls): evicted, none of a 64 MB file is there; its
    first half read, about half (and the kernel's read-ahead), by 33 pages or by 9; read whole, all of it, as a
    mincore of every page says."""
    from raylazy.io import mapping
    from raylazy.io.mapping import cached_share, in_page_cache

    size = 64 << 20
    with _evicted_mapping(tmp_path, size) as (m, path):  # its eviction's check asks mincore too: counted from here
        calls, mincore = [], mapping._libc.mincore
        monkeypatch.setattr(mapping._libc, "mincore", lambda *a: calls.append(a[1]) or mincore(*a))
        assert cached_share(m.data_ptr(), size) == 0 and calls == [1] * 33
        with open(path, "rb") as f:
            f.read(size // 2)
        calls.clear()
        assert 0.45 <= cached_share(m.data_ptr(), size) <= 0.75  # and what the kernel read ahead past it
        assert 0.4 <= cached_share(m.data_ptr(), size, most=8) <= 0.75 and len(calls) == 33 + 9
        assert not in_page_cache(m.data_ptr(), size)
        path.read_bytes()
        assert cached_share(m.data_ptr(), size) == 1 and in_page_cache(m.data_ptr(), size)


def test_populating_stays_a_window_ahead_of_the_copies(tmp_path):
    """The threads populate no further than `ahead` chunks past the furthest chunk the copies reached (a page
    brought in long before its copy may be evicted first and read twice): before any copy, only the first
    `ahead` chunks come in; once a copy reaches a chunk, the ones up to `ahead` past it do, and none further."""
    from raylazy.io.mapping import in_page_cache, populating

    mib, size = 1 << 20, 96 << 20
    with _evicted_mapping(tmp_path, size) as (m, _):
        base = m.data_ptr()

        def settled(end: int) -> None:  # wait until [0, end) is in, then a moment for anything further
            deadline = time.monotonic() + 30
            while not in_page_cache(base, end) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)

        # 4 MiB chunks, 1 ahead: before any copy, chunk 0 (the kernel's read-around may add a few MiB); a copy at
        # 40 MiB (chunk 10): up to chunk 11 (48 MiB). Without the window 2 threads read all 96 MiB in ~0.1 s.
        with populating([(m, 0, size)], threads=2, chunk_bytes=4 * mib, ahead=1) as reached:
            settled(4 * mib)
            assert in_page_cache(base, 4 * mib) and not in_page_cache(base + 16 * mib, size - 16 * mib)
            reached(base + 40 * mib + 123)
            settled(48 * mib)
            assert in_page_cache(base, 48 * mib) and not in_page_cache(base + 64 * mib, size - 64 * mib)
            reached(base + size + 4096)  # past every chunk: moves nothing
            time.sleep(0.3)
            assert not in_page_cache(base + 64 * mib, size - 64 * mib)
