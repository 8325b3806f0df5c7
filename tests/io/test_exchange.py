"""The node exchange (raylazy.io.collective) and the cooperative reader over it (raylazy.io.exchange).

A node's ranks run as separate processes, forked from a forkserver that imported torch once, over gloo on
the CPU (and, gpu-marked, over NCCL on all visible GPUs): every shard bit-for-bit against the slice of
safetensors' get_tensor its place gives it (`raytest.check_rank`); every page of the node's union read once,
as the ranks' own positional reads show (recorded in their processes: `measured.SyscallLog`); staging within the
budget; a rank that fails, dies or never comes makes the others fail with PeerFailedError instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import time
from collections import Counter
from dataclasses import asdict, replace

import pytest
import torch

import raylazy
from raylazy.core.options import ReaderOptions
from raylazy.core.schedule import node_schedule, rank_keeps
from raylazy.errors import ConfigurationError, PeerFailedError, ReadError
from raylazy.io import exchange
from raylazy.io.collective import meet_through
from raylazy.io.exchange import NodeRounds, read_rank_exchanged
from raylazy.io.nodes import node_read
from tests.support import RANK_PROCESSES, REPO
from tests.support.measured import SyscallLog, assert_header_checks_only, header_bytes, needed_pages, pages
from tests.support.raytest import check_rank

#: Seconds a whole node run may take before the test calls it hung.
DEADLINE_S = 240
HUGE = 1 << 40


def _worker(local: int, rank: int, device: str, cases: list, out_path: str, fault: str | None) -> None:
    """One rank: run every case in turn (each its own exchange), write [(shards, stats) or error] to out_path."""
    if fault == "absent":  # never joins: the others must give up at the rendezvous
        return
    if fault in ("raise", "exit", "stall"):
        read = exchange._StripeReader._read

        def broken(self, s, buf):
            if fault == "exit":
                os._exit(3)  # the process dies mid-stripe
            if fault == "stall":  # alive but silent (slow storage) for longer than the peers wait
                time.sleep(8)
                return read(self, s, buf)
            raise ReadError(f"injected failure reading stripe {s}")

        exchange._StripeReader._read = broken
    results, log = [], SyscallLog().install()
    for plan, sched, meet, budget, timeout_s in cases:
        try:
            address = meet_through(meet, local, timeout_s)
            options = ReaderOptions(staging_budget=budget, stripe_timeout_s=timeout_s)
            first = len(log.preadv)
            shards, stats = read_rank_exchanged(plan.ranks[rank], device, node_read=node_read("exchange", plan, sched, "", address),
                                                options=options)
            assert_header_checks_only(log.pread, plan)
            results.append(({n: t.cpu() for n, t in shards.items()}, asdict(stats), log.preadv[first:]))
        except Exception as e:  # noqa: BLE001  (kept as the case's result; the next case runs (its peers failed with it))
            results.append(e)
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


def run_node(tmp_path, cases: list, devices: list[str], fault: dict[int, str] | None = None) -> list[list]:
    """Run `cases` [(plan, sched, budget, timeout_s)] on one process per device (local rank = index);
    returns per case, per local rank, (shards, stats dict, its positional reads (path, start, end)) or the error it
    raised (None: no result)."""
    cases = [(plan, sched, str(tmp_path / f"meet-{c}-{time.monotonic_ns()}"), budget, t)
             for c, (plan, sched, budget, t) in enumerate(cases)]
    fault = fault or {}
    procs, paths = [], []
    for local, device in enumerate(devices):
        path = tmp_path / f"rank{local}-{time.monotonic_ns()}.pkl"
        rank = cases[0][1].ranks[local]
        procs.append(RANK_PROCESSES.Process(target=_worker, args=(local, rank, device, cases, str(path), fault.get(local)), daemon=True))
        paths.append(path)
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in hung:
        procs[i].kill()
    assert not hung, f"local rank(s) {hung} still running after {DEADLINE_S} s: the exchange hung"
    out = []
    for path in paths:
        if path.exists():
            with open(path, "rb") as f:
                out.append(pickle.load(f))
        else:
            out.append([None] * len(cases))
    return [[out[local][c] for local in range(len(devices))] for c in range(len(cases))]


def staging_need(plan, sched, rank: int, on_device: bool) -> tuple[int, int, int]:
    """(S, the rank's stripe count, the largest round's bytes) of `rank`, from the schedule and what each rank keeps
    (`rank_keeps`), as the module's docstring counts them: round t holds the t-th stripe of every reader; in it a rank
    holds the device copy of its own (on a GPU), the bytes the others keep of it (sent) and the bytes it keeps of
    theirs (received)."""
    own = {r: [s for s, st in enumerate(sched.stripes) if st.reader == r] for r in sched.ranks}
    kept = Counter()  # (stripe, rank) -> bytes the rank keeps of the stripe
    for r in sched.ranks:
        for k in rank_keeps(plan, sched, r):
            kept[k.stripe, r] += k.part.bytes_needed
    lengths = [sched.stripes[s].end - sched.stripes[s].start for s in own[rank]]
    step = 0
    for t in range(max(len(o) for o in own.values())):
        mine = own[rank][t] if t < len(own[rank]) else None
        device_copy = lengths[t] if on_device and mine is not None else 0
        sent = sum(kept[mine, r] for r in sched.ranks if r != rank) if mine is not None else 0
        received = sum(kept[own[r][t], rank] for r in sched.ranks if r != rank and t < len(own[r]))
        step = max(step, device_copy + sent + received)
    return max(lengths, default=0), len(lengths), step


def min_budget(plan, sched, on_device: bool) -> int:
    """The smallest staging budget every rank of the node can work with (some rank gets depth 1)."""
    rounds = NodeRounds(node_read("exchange", plan, sched, "", "").plans, sched)
    need = []
    for me in range(len(sched.ranks)):
        _, size, step = rounds.staging(me, HUGE, on_device)
        need.append(size + step)
    return max(need)


def check_node(plan, sched, model_dir: str, results: list, budget: int, on_device: bool = False) -> None:
    """Every rank's shards are its slices of safetensors' tensors; the ranks' positional reads cover every page of
    the node's union once and nothing else, one read per stripe (what `requests` and `bytes_read` report); staging
    fit, and is what the stats say: the deepest read-ahead the budget allows and the largest round held
    (`staging_need`)."""
    received, reads = 0, []
    for local, rank in enumerate(sched.ranks):
        res = results[local]
        assert not isinstance(res, BaseException) and res is not None, f"rank {rank}: {res!r}"
        shards, stats, calls = res
        rp = plan.ranks[rank]
        check_rank(rp, shards, model_dir)
        assert stats["bytes_needed"] == rp.stats.bytes_needed
        from_peers = sum(k.part.bytes_needed for k in rank_keeps(plan, sched, rank)
                         if sched.stripes[k.stripe].reader != rank)
        assert stats["bytes_received"] == from_peers
        assert stats["staging_bytes"] <= budget, (rank, stats["staging_bytes"], budget)
        size, stripes, step = staging_need(plan, sched, rank, on_device)
        depth = min(stripes, (budget - step) // size) if size else 0
        assert (stats["staging_buffers"], stats["staging_bytes"]) == (depth, depth * size + step), rank
        assert stats["requests"] == len(calls) and stats["bytes_read"] == sum(end - start for _, start, end in calls)
        reads += calls
        received += stats["bytes_received"]
    assert Counter(pages(reads)) == Counter(needed_pages(plan, sched.ranks))  # the union, each page read once
    assert len(reads) == len(sched.stripes)
    assert received > 0 or len(sched.ranks) == 1  # the ranks did exchange


def cases_for(model_dir: str, tp: int, on_device: bool) -> list:
    """Per stripe size: a roomy budget, then the smallest one that works (depth 1 for some rank)."""
    plan = raylazy.plan(model_dir, tp)
    out = []
    for stripe_bytes in (16384, 4096):
        sched = node_schedule(plan, range(tp), "node", stripe_bytes)
        out.append((plan, sched, 8 * min_budget(plan, sched, on_device), 60.0))
        out.append((plan, sched, min_budget(plan, sched, on_device), 60.0))
    return out


def run_and_check(tmp_path, dirs: list[str], devices: list[str]) -> list:
    tp = len(devices)
    on_device = devices[0] != "cpu"
    cases, owners = [], []
    for d in dirs:
        for c in cases_for(d, tp, on_device):
            cases.append(c)
            owners.append(d)
    results = run_node(tmp_path, cases, devices)
    for (plan, sched, budget, _), d, res in zip(cases, owners, results):
        check_node(plan, sched, d, res, budget, on_device)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_cpu_gloo_shards_bit_for_bit(tmp_path, tp, llama_dir, qwen2_dir, mixtral_dir):
    results = run_and_check(tmp_path, [llama_dir, qwen2_dir, mixtral_dir], ["cpu"] * tp)
    depths = [stats["staging_buffers"] for case in results for _, stats, _ in case]
    assert 1 in depths and max(depths) > 1  # the smallest budget reads one stripe ahead, a roomy one more


@pytest.mark.slow
def test_cpu_gloo_tp8(tmp_path, llama_dir):
    run_and_check(tmp_path, [llama_dir], ["cpu"] * 8)


def test_budget_below_the_minimum_is_refused_before_anything_starts(llama_dir):
    plan = raylazy.plan(llama_dir, 2)
    sched = node_schedule(plan, range(2), "node", 16384)
    rounds = NodeRounds(node_read("exchange", plan, sched, "", "").plans, sched)
    need = [sum(rounds.staging(me, HUGE, False)[1:]) for me in range(2)]
    rank = sched.ranks[need.index(max(need))]
    with pytest.raises(ConfigurationError, match=f"staging_budget {max(need) - 1} bytes is too small.*at least {max(need)}"):
        # no peer is started: the check comes before the exchange
        read_rank_exchanged(plan.ranks[rank], "cpu", node_read=node_read("exchange", plan, sched, "", "127.0.0.1:1"),
                            options=ReaderOptions(staging_budget=max(need) - 1))


@pytest.mark.parametrize("on_device", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_smallest_budget_holds_one_stripe_and_the_largest_round(llama_dir, tp, on_device):
    """A rank works within exactly one stripe buffer and its largest round (`staging_need`, counted from the
    schedule and the keeps: nothing for a rank alone on its CPU node), reads one more stripe ahead for each
    stripe's worth more, and refuses a byte less."""
    plan = raylazy.plan(llama_dir, tp)
    sched = node_schedule(plan, range(tp), "node", 8192)
    rounds = NodeRounds(node_read("exchange", plan, sched, "", "").plans, sched)
    for me, rank in enumerate(sched.ranks):
        size, stripes, step = staging_need(plan, sched, rank, on_device)
        assert stripes > 2 and (step > 0) == (tp > 1 or on_device)
        assert rounds.staging(me, size + step, on_device) == (1, size, step)
        assert rounds.staging(me, 2 * size + step, on_device) == (2, size, step)
        with pytest.raises(ConfigurationError, match=f"rank {rank}: .*at least {size + step}"):
            rounds.staging(me, size + step - 1, on_device)


def test_plans_not_of_the_node_in_its_ranks_order_are_refused(llama_dir):
    """The exchange needs every rank's plan in the schedule's rank order, and the reading rank among them: anything
    else is a ConfigurationError before any peer is met."""
    plan = raylazy.plan(llama_dir, 4)
    sched = node_schedule(plan, range(2), "node", 16384)
    task = node_read("exchange", plan, sched, "", "127.0.0.1:1")
    options = ReaderOptions(staging_budget=HUGE, stripe_timeout_s=1.0)
    for rank, given in ((2, task), (0, replace(task, plans=task.plans[::-1]))):
        with pytest.raises(ConfigurationError, match=r"give the node's plans in its ranks' order"):
            read_rank_exchanged(plan.ranks[rank], "cpu", node_read=given, options=options)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raise", "exit", "absent", "stall"])
def test_a_failing_rank_fails_its_peers_instead_of_hanging(tmp_path, llama_dir, fault):
    """Local rank 1 raises reading, dies mid-stripe, never joins, or stalls past the 5 s timeout."""
    plan = raylazy.plan(llama_dir, 2)
    sched = node_schedule(plan, range(2), "node", 8192)
    t0 = time.monotonic()
    (res,) = run_node(tmp_path, [(plan, sched, HUGE, 5.0)], ["cpu"] * 2, fault={1: fault})
    assert time.monotonic() - t0 < 30  # a stalled rank stops reading ahead once it fails
    assert isinstance(res[0], PeerFailedError), res[0]
    assert "local rank 0 of 2" in str(res[0]) and "5 s" in str(res[0])
    if fault in ("raise", "exit"):  # rank 1 failed before the first round's exchange, where rank 0 waited for it
        assert "exchange of round 1 of " in str(res[0]), res[0]
    if fault == "raise":
        assert isinstance(res[1], ReadError) and "injected failure" in str(res[1])
    elif fault == "stall":  # when it wakes up, its peer has given up: it fails too, nothing half-loaded
        assert isinstance(res[1], PeerFailedError), res[1]
    else:
        assert res[1] is None  # died, or never came


@pytest.mark.ray
@pytest.mark.slow
def test_rank_actors_meet_at_the_address_one_of_them_gives(llama_dir, ray_local):
    """Inside Ray: one rank actor names its node's meeting address; both actors load through the exchange."""
    import ray

    from raylazy.cluster.actor import RankLoader
    from raylazy.core.options import ReaderOptions

    plan = raylazy.plan(llama_dir, 2)
    actors = [ray.remote(num_cpus=0)(RankLoader).remote(r, "cpu") for r in range(2)]
    try:
        address = ray.get(actors[0].exchange_address.remote(), timeout=120)
        host, port = address.rsplit(":", 1)
        assert host == ray.util.get_node_ip_address() and 0 < int(port) < 65536
        task = node_read("exchange", plan, node_schedule(plan, range(2), "node", 16384), "", address)
        exchange = ReaderOptions(backend="exchange")
        stats = ray.get([a.load.remote(plan.ranks[r], exchange, task) for r, a in enumerate(actors)], timeout=120)
        # the actors' read calls (rchar, measured in each): the union once, and the header checks
        sched = task.schedule  # a rank checks the header of each file its stripes are in
        headers = sum(header_bytes(plan.files[f].uri) for r in sched.ranks for f in {s.file for s in sched.stripes
                                                                                     if s.reader == r})
        union = sched.nbytes + headers
        assert union <= sum(s.rchar for s in stats) <= 1.02 * union + 4096 and all(s.bytes_received for s in stats)
        for r, a in enumerate(actors):
            check_rank(plan.ranks[r], ray.get(a.shards.remote()), llama_dir)
    finally:
        for a in actors:
            ray.kill(a)


def _gpu_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_nccl_shards_bit_for_bit(tmp_path, llama_dir, qwen2_dir, mixtral_dir):
    """stripe -> pinned buffer -> the reader's GPU -> NCCL to the keepers, on all visible GPUs."""
    results = run_and_check(tmp_path, [llama_dir, qwen2_dir, mixtral_dir], _gpu_devices())
    assert all(s["device"].startswith("cuda") for case in results for _, s, _ in case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_staging_pipeline_stays_within_budget(tmp_path, llama_dir):
    """The smallest budget forces one pinned buffer per reader; a roomy one reads ahead; both exact."""
    results = run_and_check(tmp_path, [llama_dir], _gpu_devices())
    depths = [stats["staging_buffers"] for case in results for _, stats, _ in case]
    assert 1 in depths


# --- the GPU check script ---------------------------------------------------------------------------

ROOT = str(REPO)


def _gpu_check(*args: str):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_gpu_check_fails_fast_without_a_gpu(tmp_path):
    t0 = time.monotonic()
    done = _gpu_check("--out", str(tmp_path))
    assert done.returncode == 2 and time.monotonic() - t0 < 60
    assert "no CUDA GPU is visible" in done.stderr and "nothing was run" in done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_gpu_check_benchmark_runs_on_cpu_ranks(tmp_path, llama_dir):
    """--cpu: the benchmark part of the script (every loader, the exchange over gloo) without a GPU."""
    import json

    done = _gpu_check("--cpu", "2", "--model", llama_dir, "--warm", "--out", str(tmp_path), "--time-limit", "200")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["runs"]) == {"raw", "ranged", "fastsafetensors", "exchange"}
    assert all(r["seconds"] > 0 and not r["error"] for r in report["runs"].values()), report["runs"]
    assert "exchange" in done.stdout and "x raw" in done.stdout
