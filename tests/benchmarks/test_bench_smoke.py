"""Smoke test of `python -m benchmarks.loaders` on a tiny checkpoint, so the harness cannot rot.

Every loader at tp=2 (two ranks sharing a node, where the loaders differ; tp=1 runs the same code with
one rank), one run each, cold and warm on one node (plus one rank per node for naive and raylazy): the shards every loader produced match the reference
checksums, the cache really was cold (or warm), the storage counters moved, and the
table, CSV, JSON and chart are written, with the device's read counts (bytes, requests,
mean request size) next to the loader's processes' own read_bytes.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile

import pytest

from benchmarks.loaders import __main__ as bench
from benchmarks.loaders import impls, pagecache
from benchmarks.loaders.checkpoint import ModelSpec, checkpoint_files, ensure_checkpoint
from benchmarks.loaders.diskstats import Device
from benchmarks.loaders.needs import rank_needs

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(300)]

#: Loaders whose reads bypass the page cache (O_DIRECT): they need not pull whole pages.
O_DIRECT = ("fastsafetensors", "runai", "raylazy-fst")
TINY = ModelSpec(hidden=64, intermediate=128, heads=8, kv_heads=2, layers=2, vocab=256, shard_size="80KB")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return ensure_checkpoint(TINY, str(tmp_path_factory.mktemp("bench-cache")), log=lambda *_: None)


def test_tiny_checkpoint_is_built_once_and_needs_add_up(tiny_dir):
    assert ensure_checkpoint(TINY, os.path.dirname(tiny_dir), log=lambda *_: None) == tiny_dir  # reused
    files = checkpoint_files(tiny_dir)
    assert len(files) >= 2 and os.path.isfile(os.path.join(tiny_dir, "config.json"))
    assert pagecache.evict(files) == 0 and pagecache.resident(files) == 0
    assert pagecache.warm(files) >= sum(os.path.getsize(p) for p in files)

    import raylazy

    plan = raylazy.plan(tiny_dir, 2)
    for rp in plan.ranks:
        n = rank_needs(rp)
        assert n["exact"] == rp.stats.bytes_needed <= n["pages"]
        assert n["pages"] % pagecache.PAGE == 0
    shares = [impls.raw_share(files, 2, r) for r in range(2)]
    assert sum(b - a for s in shares for _, a, b in s) == sum(os.path.getsize(p) for p in files)


def test_held_files_stay_in_the_page_cache_until_the_block_ends(tiny_dir):
    files = checkpoint_files(tiny_dir)
    size = sum(os.path.getsize(p) for p in files)
    assert pagecache.evict(files) == 0
    with pagecache.held(files):
        assert pagecache.resident(files) >= size  # read in by the lock
        assert pagecache.evict(files, timeout_s=0.2) >= size  # locked: DONTNEED drops none of their pages
    assert pagecache.evict(files) == 0


def test_every_loader_at_tp_2(tiny_dir, tmp_path, capsys, ray_local):
    out = tmp_path / "out"
    common = ["--model-dir", tiny_dir, "--runs", "1", "--warm-runs", "1", "--rank-node-runs", "1", "--gate-cpu", "0"]
    rc = bench.main(common + ["--out", str(out), "--tp", "2", "--placements", "node"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for name in ("results.json", "results.csv", "results.md", "loaders.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert {(r["loader"], r["tp"], r["cache"]) for r in rows} == {
        (loader, 2, cache) for loader in impls.ALL_LOADERS for cache in ("cold", "warm")}
    device = data["environment"]["storage_device"]
    for r in rows:
        assert r["verified"] == ("n/a" if r["loader"] == "raw" or r["cache"] == "warm" else "ok"), r
        if r["cache"] == "cold":
            assert r["resident_before_max"] == 0 and r["pulled_bytes"] > 0, r  # evicted before every run
        else:
            assert r["resident_before_max"] >= data["environment"]["checkpoint_bytes"], r
        _check_storage_columns(r, device, data["environment"]["storage_device_missing"])
        assert r["wall_s"] > 0 and r["cpu_s"] >= 0, r
        assert r["peak_rss_per_rank"] > 0 and r["peak_anon_per_rank"] > 0, r
        if r["loader"].startswith("raylazy"):
            assert r["e2e_s"] >= r["wall_s"] > 0, r
    for rec in data["records"]:
        assert len(rec["ranks"]) == rec["tp"]
    with open(out / "results.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    for loader in impls.ALL_LOADERS:
        assert loader in printed

    out2 = tmp_path / "out2"
    rc = bench.main(common + ["--out", str(out2), "--tp", "2", "--placements", "rank-per-node",
                              "--loaders", "naive,raylazy-ranged", "--no-chart"])
    assert rc == 0, capsys.readouterr().out
    data = json.loads((out2 / "results.json").read_text())
    rows = data["rows"]
    assert {(r["loader"], r["placement"], r["cache"]) for r in rows} == {
        ("naive", "rank-per-node", "cold"), ("raylazy-ranged", "rank-per-node", "cold")}
    for r in rows:
        assert r["verified"] == "ok" and r["resident_before_max"] == 0 and r["amp_rank_max"] > 0, r
        _check_storage_columns(r, data["environment"]["storage_device"], data["environment"]["storage_device_missing"])


def _check_storage_columns(r: dict, device: str | None, missing: str | None) -> None:
    """Bytes pulled are the device's count when /proc/diskstats has the checkpoint's device, else the loader's
    processes' read_bytes and the environment says why; a cold run pulled at least every page it needs (on one node,
    the union over the ranks), in requests whose mean is bytes / requests."""
    assert r["procs_read_bytes"] >= 0, r
    if device is None:
        assert missing and r["pulled_from"] == "read_bytes" and r["pulled_bytes"] == r["procs_read_bytes"], r
        assert r["mean_request_bytes"] is None and r["dev_requests"] is None, r
        return
    assert r["pulled_from"] == "diskstats" and r["dev_requests"] >= 0 and r["dev_merged"] >= 0, r
    if r["cache"] == "cold":
        # the device served all the ranks submitted, and at least every page they need (every byte they need
        # for the O_DIRECT readers, which read 512-byte sectors past the page cache)
        need = r["need_exact_bytes"] if r["loader"] in O_DIRECT else r["need_pages_bytes"]
        assert r["pulled_bytes"] >= max(need, r["procs_read_bytes"]) > 0, r
        assert r["dev_requests"] > 0 and 512 <= r["mean_request_bytes"] <= r["pulled_bytes"], r


def test_unknown_placement_or_cache_is_refused(capsys):
    """A misspelt scenario must not run as another one (`one-node` once ran every rank alone)."""
    for flag, bad in (("--placements", "one-node"), ("--caches", "hot"), ("--loaders", "naive,fast")):
        with pytest.raises(SystemExit) as e:
            bench.main(["--model-dir", "/nonexistent", flag, bad])
        assert repr(bad.split(",")[-1]) in str(e.value) and "choose from" in str(e.value), e.value


def test_diskstats_device_of_the_checkpoint(tiny_dir):
    """The device holding the checkpoint is found in /proc/diskstats, or it says why not; a cold read of
    a file counts at least its pages on that device."""
    files = checkpoint_files(tiny_dir)
    disk = Device(files)
    if disk.name is None:
        assert "diskstats" in disk.missing or "devices" in disk.missing
        pytest.skip(disk.missing)
    with open("/proc/diskstats") as fh:
        assert disk.name in {line.split()[2] for line in fh}
    assert pagecache.evict(files) == 0
    before = disk.reads()
    assert pagecache.warm(files) >= sum(os.path.getsize(p) for p in files)
    got = disk.settled_reads() - before
    assert got.bytes >= sum(os.path.getsize(p) for p in files) and got.requests > 0
    assert got.mean_request == got.bytes / got.requests
    assert Device(["/proc/self/status"]).name is None  # procfs: no block device, and a reason
    assert "no /proc/diskstats line" in Device(["/proc/self/status"]).missing


def test_without_a_block_device_pulled_falls_back_to_read_bytes(tiny_dir, tmp_path, capsys):
    """A checkpoint on tmpfs has no /proc/diskstats line: pulled is the processes' read_bytes, and the run says why."""
    if not os.path.isdir("/dev/shm") or Device(["/dev/shm"]).name is not None:
        pytest.skip("no tmpfs at /dev/shm")
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="raylazy-bench-")
    try:
        model = shutil.copytree(tiny_dir, os.path.join(shm, "model"))
        out = tmp_path / "out"
        rc = bench.main(["--model-dir", model, "--out", str(out), "--tp", "1", "--loaders", "naive", "--caches", "warm",
                         "--placements", "node", "--warm-runs", "1", "--gate-cpu", "0", "--no-chart", "--no-verify"])
        assert rc == 0, capsys.readouterr().out
    finally:
        shutil.rmtree(shm)
    data = json.loads((out / "results.json").read_text())
    assert data["environment"]["storage_device"] is None
    (row,) = data["rows"]
    _check_storage_columns(row, None, data["environment"]["storage_device_missing"])
