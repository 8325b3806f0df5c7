"""Object storage (`s3://`) against a real S3 server: SeaweedFS on loopback ports, behind a proxy that counts each
request and its bytes and fails requests on demand (benchmarks/s3server.py; the session's `s3` fixture, in
conftest.py): the bytes and requests checked are the proxy's counts. Shards are compared bit for bit with the slice
of safetensors' own tensors each rank's place gives it (`raytest.check_rank`)."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from collections import Counter

import pytest

pytest.importorskip("obstore")

import raylazy
from benchmarks.s3server import SeaweedFS
from raylazy.cli import main as cli_main
from raylazy.core.checkpoint import INDEX_NAME
from raylazy.core.choices import choose_backend
from raylazy.core.estimate import figures
from raylazy.core.hardware import preset
from raylazy.core.options import ReaderOptions
from raylazy.core.schedule import rank_schedule, request_runs
from raylazy.errors import (
    CheckpointNotFoundError,
    ConfigurationError,
    FileChangedError,
    MissingShardError,
    ReadError,
    StorageAccessError,
)
from raylazy.io.nodes import shares_page_cache
from raylazy.io.ranged import read_rank_ranged
from raylazy.io.shared import shm_dir
from raylazy.planning import make_plan
from raylazy.storage import open_checkpoint, open_source, storage_for
from raylazy.storage.objects import HEAD_BYTES, ObjectSource, ObjectStorage
from tests.support.checkpoints import shard_files
from tests.support.raytest import check_loaded, check_rank

BUCKET = "raylazy-test"


@pytest.fixture(scope="module")
def s3_llama(s3, llama_dir) -> str:
    return s3.upload_dir(llama_dir, BUCKET, "llama")


def test_plan_is_one_list_and_one_get_per_file(s3, s3_llama, llama_dir):
    """Discovery and headers in the fewest requests: the directory's LIST, then one GET of each file's first
    HEAD_BYTES (the index, each shard's header, config.json), whose response gives size and ETag."""
    s3.reset()
    plan = make_plan(s3_llama, 2, storage_options=s3.storage_options, max_gap=0)
    requests = s3.reset().requests
    local = make_plan(llama_dir, 2)
    assert plan.root == s3_llama and [f.uri for f in plan.files] == [f"{s3_llama}/{n}" for n in shard_files(llama_dir)]
    assert [rp.tensors for rp in plan.ranks] == [rp.tensors for rp in local.ranks]
    assert [(f.size, f.digest) for f in plan.files] == [(f.size, f.digest) for f in local.files]
    assert [f.version for f in plan.files] == [s3.etags[f"{BUCKET}/llama/{n}"] for n in shard_files(llama_dir)]
    got = [(r.method, r.path, r.range) for r in requests]
    head = [("GET", f"/{BUCKET}/llama/{n}", f"bytes=0-{HEAD_BYTES - 1}") for n in
            ["model.safetensors.index.json", *shard_files(llama_dir), "config.json"]]
    # the listing, the index, the shards' headers (read at once: in any order), config.json
    assert got[:2] == [("GET", f"/{BUCKET}?delimiter=%2F&list-type=2&prefix=llama%2F", None), head[0]]
    assert sorted(got[2:-1]) == sorted(head[1:-1]) and got[-1] == head[-1]
    # the command line takes the same options
    assert cli_main(["plan", s3_llama, "--tp", "2"] + [f"--storage-option={k}={v}" for k, v in
                                                       s3.storage_options.items()]) == 0


def test_a_header_longer_than_the_first_get_costs_one_more(s3, tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors = {f"layer.{i}.a_rather_long_tensor_name_to_fill_the_header.weight": torch.full((2,), float(i))
               for i in range(1000)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    length = 8 + int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    assert length > HEAD_BYTES
    uri = s3.upload_dir(str(tmp_path), BUCKET, "long-header")
    s3.reset()
    ckpt = open_checkpoint(f"{uri}/model.safetensors", s3.storage_options)
    gets = s3.reset().gets("/long-header/model.safetensors")
    assert [g.range for g in gets] == [f"bytes=0-{HEAD_BYTES - 1}", f"bytes={HEAD_BYTES}-{length - 1}"]
    assert sorted(t.name for _, t in ckpt.tensors()) == sorted(tensors)


@pytest.mark.parametrize("tp, max_gap, part_bytes", [(2, 0, None), (4, None, None), (4, None, 4096)])
def test_ranks_fetch_only_their_ranges(s3, s3_llama, llama_dir, tp, max_gap, part_bytes):
    options = dict(s3.storage_options, **({"part_bytes": part_bytes} if part_bytes else {}))
    plan = make_plan(s3_llama, tp, storage_options=options, max_gap=max_gap)
    for rp in plan.ranks:
        s3.reset()
        shards, stats = read_rank_ranged(rp, "cpu", options=ReaderOptions(storage_options=options, chunk_bytes=8192))
        counts = s3.reset()
        check_rank(rp, shards, llama_dir)
        # a planned object is reopened at its ETag without a request: every GET is data (If-Match checks the ETag)
        assert {r.method for r in counts.requests} == {"GET"}
        fetched = counts.get_bytes("/llama/")
        assert fetched == rp.stats.bytes_read, (rp.rank, fetched, rp.stats.bytes_read)
        if max_gap == 0:  # exactly the needed bytes
            assert rp.stats.bytes_read == stats.bytes_needed
        ranges = len(counts.gets("/llama/"))
        windows = len(rank_schedule(rp, 8192).windows)  # a range that spans windows is one GET per window
        assert stats.requests <= ranges <= (stats.requests + windows) * (2 if part_bytes else 1), (ranges, stats.requests)


@pytest.mark.parametrize("part_bytes", [None, 4096])  # each window one GET; windows in parts (and single GETs)
def test_a_rank_keeps_max_concurrency_gets_in_flight(s3, s3_llama, llama_dir, part_bytes):
    """Against a store slow to answer, one reader thread still keeps `max_concurrency` GETs in flight (a source
    asks for that many windows at once), and never more."""
    plan = make_plan(s3_llama, 2, storage_options=s3.storage_options)
    options = dict(s3.storage_options, max_concurrency=4, **({"part_bytes": part_bytes} if part_bytes else {}))
    s3.first_byte_s = 0.02
    try:
        s3.reset()
        shards, _ = read_rank_ranged(plan.ranks[0], "cpu", options=ReaderOptions(storage_options=options, threads=1,
                                                                           chunk_bytes=8192))
        counts = s3.reset()
    finally:
        s3.first_byte_s = 0.0
    check_rank(plan.ranks[0], shards, llama_dir)
    assert counts.most_in_flight == 4, counts.most_in_flight


def test_retries_throttling_and_resets_then_reports(s3, s3_llama, llama_dir):
    plan = make_plan(s3_llama, 2, storage_options=s3.storage_options, max_gap=0)
    options = ReaderOptions(storage_options=s3.storage_options)
    s3.reset()
    # the data GETs (opening a planned object costs none): 503s, resets, two cut half-way through the body
    s3.faults = ["503", "reset", None, "503", None, None, "reset", "503", None, None, None, None, "cut", None, "cut"]
    shards, _ = read_rank_ranged(plan.ranks[0], "cpu", options=options)
    check_rank(plan.ranks[0], shards, llama_dir)
    requests = s3.reset().requests
    assert [r.status for r in requests].count(503) == 3 and not s3.faults
    cut = [r for r in requests if r.fault == "cut"]
    assert len(cut) == 2 and all(r.method == "GET" and r.range and r.body_bytes for r in cut)
    s3.faults = ["503"] * 1000
    t0 = time.monotonic()
    with pytest.raises(ReadError, match=r"s3://.*503"):
        read_rank_ranged(plan.ranks[1], "cpu", options=options)
    assert time.monotonic() - t0 < 10
    assert 1000 - len(s3.faults) >= 4  # tried, then retried max_retries times
    s3.faults = []


def test_a_failed_part_leaves_the_buffers_alone_once_the_read_raises(monkeypatch):
    """A range fetched as parts: one part fails while a sibling is still fetching. The read raises that error only
    once no part can write into the caller's buffers any more (the sibling stops at its next chunk), and the parts
    not yet started send no GET. The real `readinto`, with `_get` answering from the test."""
    storage = ObjectStorage("s3", {"part_bytes": 4, "max_concurrency": 2})
    source = ObjectSource(storage, None, "k", "s3://bucket/k", 16, "etag")
    asked = []

    class Answer:
        def __init__(self, start):
            self.start = start

        def stream(self, min_chunk_size):
            if self.start == 0:  # the first part fails once the second is under way
                time.sleep(0.05)
                raise RuntimeError("503 Slow Down")
            time.sleep(0.3)  # the second answers after the failure
            yield b"x" * 4

    def get(start, end):
        asked.append(start)
        return Answer(start)

    monkeypatch.setattr(source, "_get", get)
    buf = bytearray(16)
    with pytest.raises(OSError, match="503 Slow Down"):
        source.readinto(0, [memoryview(buf)])
    after = bytes(buf)
    time.sleep(0.5)  # longer than the second part took
    assert bytes(buf) == after == bytes(16)
    assert sorted(asked) == [0, 4]


def test_object_replaced_after_planning_is_detected(s3, llama_dir, tmp_path):
    copy = shutil.copytree(llama_dir, tmp_path / "m")
    uri = s3.upload_dir(str(copy), BUCKET, "replaced")
    plan = make_plan(uri, 2, storage_options=s3.storage_options, max_gap=0)
    rp = plan.ranks[0]
    name = shard_files(llama_dir)[-1]
    data = bytearray((copy / name).read_bytes())
    data[-1] ^= 0xFF  # same size, same header: only the ETag tells
    with open_source(f"{uri}/{name}", s3.storage_options) as opened:  # a reader that opened the old version
        s3.put(BUCKET, f"replaced/{name}", bytes(data))
        with pytest.raises(FileChangedError, match="was replaced .*ETag is no longer"):
            opened.read(opened.size - 10, 10)
    with pytest.raises(FileChangedError, match=f"{name}: the object was replaced .*the version planned.*plan again"):
        read_rank_ranged(rp, "cpu", options=ReaderOptions(storage_options=s3.storage_options))


def test_missing_bucket_prefix_or_shard_is_a_clear_error_at_once(s3, s3_llama, llama_dir, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(CheckpointNotFoundError, match="s3://no-such-bucket/llama: no such bucket 'no-such-bucket'"):
        open_checkpoint("s3://no-such-bucket/llama", s3.storage_options)
    for uri in (f"{s3_llama}-nope", f"s3://{BUCKET}/llama/nope.safetensors"):
        with pytest.raises(CheckpointNotFoundError, match=f"{uri}: no such file or directory"):
            open_checkpoint(uri, s3.storage_options)
    partial = shutil.copytree(llama_dir, tmp_path / "partial")
    os.remove(partial / shard_files(llama_dir)[0])
    with pytest.raises(MissingShardError, match=shard_files(llama_dir)[0]):
        open_checkpoint(s3.upload_dir(str(partial), BUCKET, "partial"), s3.storage_options)
    assert time.monotonic() - t0 < 5


def test_unreachable_endpoint_and_bad_options_are_named(s3, s3_llama):
    with socket_closed_port() as port:
        options = dict(s3.storage_options, endpoint=f"http://127.0.0.1:{port}", max_retries=1)
        t0 = time.monotonic()
        with pytest.raises(StorageAccessError, match=r"s3://.*cannot list.*AWS_ENDPOINT_URL"):
            open_checkpoint(s3_llama, options)
        assert time.monotonic() - t0 < 10
    with pytest.raises(ConfigurationError, match="no_such_key"):
        open_checkpoint(s3_llama, dict(s3.storage_options, no_such_key="1"))
    with pytest.raises(ConfigurationError, match="local files take no storage_options"):
        open_checkpoint("/tmp", {"region": "x"})
    assert "secret" not in repr(ReaderOptions(storage_options={"secret_access_key": "secret"}))  # kept out of logs


def test_environment_configures_the_client(s3, s3_llama, llama_dir, monkeypatch):
    for key, value in dict(AWS_ENDPOINT_URL=s3.endpoint, AWS_ALLOW_HTTP="true", AWS_ACCESS_KEY_ID="testing",
                           AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(raylazy.storage.registry, "_STORAGES", {})  # clients are built from the environment when first used
    plan = make_plan(s3_llama, 2, max_gap=0)
    assert [rp.tensors for rp in plan.ranks] == [rp.tensors for rp in make_plan(llama_dir, 2).ranks]


def test_node_backends_on_object_storage(s3_llama):
    from raylazy.core.plans import FileRef

    ref = (FileRef(uri=f"{s3_llama}/model.safetensors", size=1, digest=""),)
    # no page cache to share: a node's CPU ranks fetch each stripe once into shared memory and copy out of it, GPU
    # ranks exchange it; a rank alone reads ranged
    shared = shares_page_cache(ref)
    assert not shared
    assert {choose_backend(b, 4, "cpu", shared).backend for b in ("auto", "cooperative")} == {"cooperative"}
    assert {choose_backend(b, 4, "cuda", shared).backend for b in ("auto", "cooperative")} == {"exchange"}
    assert choose_backend("exchange", 4, "cpu", shared).backend == "exchange"
    assert choose_backend("auto", 1, "cpu", shared).backend == "ranged"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "exchange", "ranged"])
def test_load_from_s3(ray_local, s3, s3_llama, llama_dir, backend):
    s3.reset()
    stages = lambda: {n for d in (shm_dir(), tempfile.gettempdir()) for n in os.listdir(d) if n.endswith(".stage")}  # noqa: E731
    before = stages()
    with raylazy.load(s3_llama, 2, storage_options=s3.storage_options, max_gap=0, device="cpu", backend=backend,
                      stripe_bytes=65536) as loaded:
        counts = s3.reset()
        check_loaded(loaded, llama_dir)
        files = shard_files(llama_dir)
        gets = Counter((g.path.rsplit("/", 1)[1], g.range) for g in counts.gets("/llama/"))
        heads = Counter((n, f"bytes=0-{HEAD_BYTES - 1}") for n in [*files, INDEX_NAME, "config.json"])
        assert gets & heads == heads  # the driver's; the ranks open planned objects without a request
        data = gets - heads
        if backend != "ranged":  # two ranks on one node: each stripe fetched once for both, in one request
            assert {s.backend for s in loaded.stats} == {"cooperative" if backend == "auto" else "exchange"}
            assert stages() == before  # the stages in shared memory are gone with the read
            node = loaded.plan.nodes[0]
            # cooperative (staged): a reader's adjacent stripes in one request, the edges of a direct block with it
            runs = [run for r in node.ranks for run in request_runs(node, r)] if backend == "auto" else \
                [(i,) for i in range(len(node.stripes))]
            assert len(runs) < len(node.stripes) or backend == "exchange"
            assert data == Counter((files[node.stripes[run[0]].file],
                                    f"bytes={node.stripes[run[0]].start}-{node.stripes[run[-1]].end - 1}") for run in runs)
            if backend == "auto":  # the load-time model counts the GETs the node made
                hardware = preset("nvme-node").model_dump()
                hardware["storage"].update(kind="s3", page_cache=False, request_bytes=65536)
                hardware["node"]["gpus"] = 0
                fig = figures(loaded.plan, hardware, ranks_per_node=2)
                assert (fig.nodes[0].backend, fig.nodes[0].requests) == ("cooperative", sum(data.values()))
            assert node.nbytes <= 1.02 * loaded.plan.checkpoint_bytes
        else:  # each rank its own ranges: one request per row with max_gap=0
            assert {s.backend for s in loaded.stats} == {"ranged"}
            sizes = {(g.path.rsplit("/", 1)[1], g.range): g.body_bytes for g in counts.gets("/llama/")}
            assert sum(sizes[k] * n for k, n in data.items()) == sum(s.bytes_read for s in loaded.stats)
            assert data.total() > 100


def test_cost_model_is_measured_on_the_first_requests_unless_given(s3, s3_llama):
    """The storage times its first GETs (discovery's): against a store 50 ms from its first byte, the estimate's
    latency is that; given storage options win."""
    options = dict(s3.storage_options, max_concurrency=7)  # a storage of its own: nothing measured before
    s3.first_byte_s = 0.05
    try:
        open_checkpoint(s3_llama, options)
    finally:
        s3.first_byte_s = 0.0
    cost = storage_for(s3_llama, options).cost_model(s3_llama)
    assert 0.05 <= cost.request_s < 0.5 and cost.concurrency == 7 and cost.bandwidth_bps == 0
    given = dict(options, request_latency=0.002, connection_bandwidth=5e6, bandwidth=1e9, request_rate=100)
    cost = storage_for(s3_llama, given).cost_model(s3_llama)
    assert (cost.request_s, cost.connection_bps, cost.bandwidth_bps, cost.request_rate) == (0.002, 5e6, 1e9, 100)
    with pytest.raises(ConfigurationError, match="request_latency"):
        storage_for(s3_llama, dict(options, request_latency="soon"))
    # planned with a store far away per request (row by row never pays) and one slow per byte (whole never pays)
    far = make_plan(s3_llama, 2, storage_options=dict(options, request_latency=10.0))
    slow = make_plan(s3_llama, 2, storage_options=dict(options, request_latency=1e-9, connection_bandwidth=1e3))
    assert far.max_gap is None and all(r.gather for rp in far.ranks for t in rp.tensors for r in t.reads if r.count > 1)
    assert not any(r.gather for rp in slow.ranks for t in rp.tensors for r in t.reads)
    assert slow.bytes_read == slow.bytes_needed < far.bytes_read


def test_seaweedfs_stops_without_a_trace(s3):
    """A second server beside the session's (another test session on this machine) takes other ports, and stops
    leaving no process, directory or socket behind."""
    server = SeaweedFS()
    ports, pid, where = dict(server.ports), server.proc.pid, server.dir
    assert not set(ports.values()) & set(s3.seaweed.ports.values())
    assert glob.glob(f"/tmp/seaweedfs-*-grpc-{ports['s3'] + 10000}.sock")
    server.stop()
    assert not os.path.exists(f"/proc/{pid}") and not os.path.exists(where)
    assert not [p for port in ports.values() for p in glob.glob(f"/tmp/seaweedfs-*-{port + 10000}.sock")]


class socket_closed_port:
    """A port on 127.0.0.1 nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return port

    def __exit__(self, *exc) -> None:
        pass


@pytest.mark.slow
def test_the_s3_benchmark_runs(llama_dir, tmp_path):
    """`python -m benchmarks.s3`'s harness on the tiny checkpoint (a rank alone; its own server): raylazy's and
    Run:ai's shards are bit-identical (the run fails otherwise), the plain GET moves exactly the rank's bytes; and
    without the proxy (`--no-proxy`)."""
    from benchmarks import s3 as bench

    rows = bench.run(llama_dir, [1], str(tmp_path), nodes=False, log=lambda line: None)
    by = {r["loader"]: r for r in rows}
    assert set(by) == {"plan", "raylazy", "runai", "get"}
    assert by["plan"]["requests"] == len(shard_files(llama_dir)) + 3  # LIST, index, shards, config.json
    assert by["get"]["bytes"] == by["get"]["needed"] == by["raylazy"]["needed"] == by["raylazy"]["bytes"]
    assert by["raylazy"]["estimate"] > 0 and "| raylazy | rank | 1 | 0 |" in bench.table(rows)
    # straight to SeaweedFS: the same loaders, nothing counted (the proxy counts), no planning row
    rows = bench.run(llama_dir, [1], str(tmp_path), nodes=False, proxy=False, log=lambda line: None)
    assert [r["loader"] for r in rows] == ["raylazy", "runai", "get"]
    assert all(r["seconds"] > 0 and r["bytes"] is r["requests"] is None for r in rows)
    assert "| get | rank | 1 | 0 |" in bench.table(rows)
