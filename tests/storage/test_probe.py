"""The probe of a network mount's wait and depth (`raylazy.storage.probe`), on the emulated mount in its `direct`
mode (every read a request its server counts) set to a latency and a number of server threads: the figures it
finds are the ones the mount was given, the reads it adds are the ones its docstring names, a mount is probed once
for the process, a mount the kernel describes is not probed, and a file that cannot be read, is too small, or a
mount that stops answering leaves the table's figures without an error."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

import raylazy
from raylazy.core.costs import _OTHER_NETWORK, for_kind
from raylazy.core.options import ReaderOptions
from raylazy.storage import storage_for
from raylazy.storage.kinds import storage_kind
from raylazy.storage.probe import SERIAL, TOGETHER, measure
from tests.support.checkpoints import probe_bytes

LATENCY_S = 0.05


def checkpoint(where, header_bytes: int = 10_000) -> str:
    """A directory holding one safetensors file whose header (8-byte length and JSON) is `header_bytes`."""
    os.makedirs(where, exist_ok=True)
    tensor = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    pad = header_bytes - 8 - len(json.dumps({"__metadata__": {"pad": ""}, **tensor}))
    header = json.dumps({"__metadata__": {"pad": " " * pad}, **tensor}).encode()
    with open(os.path.join(where, "model.safetensors"), "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + bytes(16))
    return str(where)


def warmed(fs, latency_s: float):
    """`fs` with its server's threads started (as many reads at once as the probe makes, at a short latency), then
    answering after `latency_s`, its counts zeroed: the emulator's Python server starts a thread for each request
    in flight, slower than the storage it stands for on a busy machine."""
    fs.control(latency_s=0.01)
    fd = os.open(fs.path("model.safetensors"), os.O_RDONLY)
    readers = [threading.Thread(target=os.pread, args=(fd, 4096, 0)) for _ in range(TOGETHER)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    os.close(fd)
    fs.control(latency_s=latency_s, reset=True)
    return fs


@pytest.mark.parametrize("threads,depth", [(2, 2), (5, 5), (64, 0)])
def test_the_probe_finds_the_wait_and_depth_the_mount_was_given(netfs, tmp_path, threads, depth):
    """A mount answering each read after 50 ms from `threads` server threads: the server serves the probe's 16
    reads of the header's first 4 KiB (the first, its 8-byte length), `threads` at once at most; the cost model
    and the readers' threads take the probe's figures. Of three probes (a busy machine's scheduling delays can
    split the ends of reads served together), the median wait is 50 ms (within 25%) and the median depth is
    `threads` (64, more than the probe's 12 reads at once: not told, the table's stands)."""
    fs = warmed(netfs(checkpoint(tmp_path / "ckpt"), mode="direct", max_threads=threads), LATENCY_S)
    kind = storage_kind(fs.mountpoint)
    stats = fs.stats()
    assert (stats["requests"], stats["bytes"]) == (SERIAL + TOGETHER, 8 + 15 * 4096) == (
        SERIAL + TOGETHER, probe_bytes(fs.source))
    assert stats["most_in_flight"] == min(threads, TOGETHER)
    costs = storage_for(fs.mountpoint).cost_model(fs.mountpoint, kind)
    assert (costs.request_s, costs.concurrency) == (kind.latency_s, kind.depth or _OTHER_NETWORK.concurrency)
    assert ReaderOptions().shaped(costs).threads == costs.concurrency
    waits, depths = zip((kind.latency_s, kind.depth), *(measure(fs.path("model.safetensors")) for _ in range(2)))
    assert LATENCY_S <= sorted(waits)[1] <= 1.25 * LATENCY_S and sorted(depths)[1] == depth, (waits, depths)


def test_a_mount_is_probed_once_for_the_process(netfs, tmp_path):
    """Four threads asking the kind of a fresh mount at once: one probe (its 16 reads); asked again, and planned:
    no read more than the planning's own."""
    fs = netfs(checkpoint(tmp_path / "ckpt"), mode="direct", latency_s=0.01)
    kinds = []
    askers = [threading.Thread(target=lambda: kinds.append(storage_kind(fs.mountpoint))) for _ in range(4)]
    for t in askers:
        t.start()
    for t in askers:
        t.join()
    assert len(kinds) == 4 and len(set(kinds)) == 1 and kinds[0].latency_s >= 0.01, kinds
    assert fs.stats()["requests"] == SERIAL + TOGETHER
    fs.reset()
    assert storage_kind(fs.mountpoint) == kinds[0] and fs.stats()["requests"] == 0
    plan = raylazy.plan(fs.mountpoint, rules=[("w", raylazy.Replicated())])
    assert plan.storage == kinds[0]
    # the summary's storage line says the wait timed: at least the 10 ms the mount was given
    (line,) = [line for line in plan.summary().splitlines() if line.startswith("storage: ")]
    (wait,) = re.findall(r", ([0-9.]+) ms a request \(probed\)", line)
    assert 10 <= float(wait) < 100, line


def test_a_mount_the_kernel_describes_is_not_probed(netfs, tmp_path):
    """A mount keeping its pages (the kernel says its depth, and a read again would come from the page cache): not
    probed, nothing read."""
    fs = netfs(checkpoint(tmp_path / "ckpt"), mode="cached", latency_s=0.01)
    kind = storage_kind(fs.mountpoint)
    assert kind.page_cache and kind.latency_s == 0 and fs.stats()["requests"] == 0
    assert for_kind(kind).request_s == _OTHER_NETWORK.request_s
    # the summary's storage line says the requests' shape the kernel gives the mount (its bdi's read-ahead, the
    # FUSE connection's max_background), without a probed wait
    device = os.stat(fs.mountpoint).st_dev
    with open(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb") as f:
        read_ahead_kb = int(f.read())
    with open(f"/sys/fs/fuse/connections/{os.minor(device)}/max_background") as f:
        depth = int(f.read())
    assert kind.describe().endswith(f", requests of {read_ahead_kb} KiB, {depth} in flight"), kind.describe()
    assert f"storage: {kind.describe()}" in raylazy.plan(fs.mountpoint, rules=[("w", raylazy.Replicated())]) \
        .summary().splitlines()


@pytest.mark.parametrize("why", ["unreadable", "too small"])
def test_a_file_the_probe_cannot_read_leaves_the_tables_figures(netfs, tmp_path, why):
    """Every read failing (EIO), or a first file shorter than a header's length: no figures, no error."""
    src = checkpoint(tmp_path / "ckpt")
    if why == "too small":
        with open(os.path.join(src, "a.safetensors"), "wb") as f:  # sorted first
            f.write(b"\x10\x00\x00")
    fs = netfs(src, mode="direct", latency_s=0.01)
    if why == "unreadable":
        fs.control(fault={"fail": 5})
    # a file shorter than a page cannot be mapped to show direct_io: said here
    kind = storage_kind(fs.mountpoint, uncached=True if why == "too small" else None)
    assert (kind.latency_s, kind.depth) == (0, 0) and fs.stats()["requests"] == (1 if why == "too small" else 0)
    assert for_kind(kind) == _OTHER_NETWORK


def test_a_mount_that_stops_answering_is_given_up_within_the_timeout(netfs, tmp_path):
    """Reads that stall: no figures once the timeout passes; the probe's reads end once the mount answers."""
    fs = netfs(checkpoint(tmp_path / "ckpt"), mode="direct", latency_s=0.01)
    fs.control(fault={"stall": True})
    t0 = time.monotonic()
    try:
        assert measure(fs.path("model.safetensors"), timeout_s=0.5) is None
        assert time.monotonic() - t0 < 2.5
    finally:
        fs.control(fault=None)
    deadline = time.monotonic() + 10
    while any(t.name.startswith("raylazy-probe") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name.startswith("raylazy-probe") for t in threading.enumerate())
