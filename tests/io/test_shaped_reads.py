"""Reads shaped for the storage they come from (`ReaderOptions.shaped`, `raylazy.core.costs.for_kind`,
`raylazy.core.choices.choose_backend`): on network storage more requests in flight and larger ones than on a local disk,
options given explicitly kept, rows of split tensors gathered where requests cost, and a node with no page cache to
share fetching its union once through the exchange, as the emulated mount counts what reached it."""

from __future__ import annotations

import os

import pytest
import torch

import raylazy
from raylazy.core.choices import choose_backend
from raylazy.core.costs import for_kind
from raylazy.core.kinds import StorageKind
from raylazy.core.options import ReaderOptions
from raylazy.io.nodes import shares_page_cache
from tests.support.checkpoints import probe_bytes, reference_tensors
from tests.support.expected import expected_rank, model_config
from tests.support.measured import header_bytes

LOCAL = StorageKind(name="local", fs_type="ext4", network=False, page_cache=True, mount_point="/")
NETWORK = [StorageKind(name=n, fs_type=t, network=True, page_cache=c, mount_point="/mnt")
           for n, t, c in (("nfs", "nfs4", True), ("lustre", "lustre", True), ("cephfs", "ceph", True),
                           ("gcsfuse", "fuse.gcsfuse", True), ("mountpoint-s3", "fuse", False),
                           ("fuse", "fuse.unknown", False), ("smb", "cifs", True))]


def test_a_local_disk_keeps_the_defaults_and_network_storage_gets_deeper_larger_reads():
    default = ReaderOptions()
    assert for_kind(LOCAL) is None and default.shaped(for_kind(LOCAL)) == default
    for kind in NETWORK:
        shaped = default.shaped(for_kind(kind))
        assert shaped.threads >= 4 * default.threads, kind
        assert shaped.chunk_bytes == shaped.stripe_bytes >= 512 << 10, kind
        assert shaped.backend == default.backend and shaped.staging_budget == default.staging_budget


def test_options_given_explicitly_are_kept():
    mine = ReaderOptions(threads=2, stripe_bytes=1 << 16)
    shaped = mine.shaped(for_kind(NETWORK[0]))
    assert (shaped.threads, shaped.stripe_bytes) == (2, 1 << 16)
    assert shaped.chunk_bytes == for_kind(NETWORK[0]).part_bytes != mine.chunk_bytes


def test_a_node_shares_pages_only_where_the_kernel_keeps_them():
    for kind in (LOCAL, *NETWORK):
        shared = shares_page_cache((), kind)
        for requested in ("auto", "cooperative"):  # without a page cache, CPU ranks through stages, GPUs exchange
            got = choose_backend(requested, 4, "cpu", shared)
            assert got.backend == "cooperative" and got.with_node, kind.name
            assert choose_backend(requested, 4, "cuda:0", shared).backend == "exchange" or kind.page_cache, kind.name
        assert choose_backend("auto", 1, "cpu", shared).backend == "ranged"  # alone on its node: its own ranges
        assert choose_backend("ranged", 4, "cpu", shared).backend == "ranged"  # asked for


def test_rows_of_split_tensors_are_gathered_where_requests_cost(netfs, llama_dir):
    """Through the emulated mount (a network kind) the row-split tensors' rows are read as ranges with the gaps
    (fewer requests); on the local disk row by row, exactly the bytes needed."""
    fs = netfs(llama_dir, mode="direct", latency_s=0.001)
    for root, gathered in ((llama_dir, False), (fs.mountpoint, True)):
        reads = [r for rp in raylazy.plan(root, tp=2).ranks for t in rp.tensors for r in t.reads if r.count > 1]
        assert reads and any(r.gather for r in reads) == gathered, root


@pytest.mark.ray
def test_a_node_without_a_page_cache_fetches_its_union_once(netfs, llama_dir, ray_local):
    """raylazy.load tp=2 from an uncached (direct_io) mount: the node reads through stages in shared memory, the
    storage serves its union once (plus the headers planning and the ranks' checks read, and the probe of the mount
    at the planning: `raylazy.storage.probe`), every shard is the checkpoint's slice, and the stats and summary say
    what storage was read and how."""
    fs = netfs(llama_dir, mode="direct", latency_s=0.001)
    tp, cfg = 2, model_config(llama_dir)
    with raylazy.load(fs.mountpoint, tp, device="cpu", progress=False) as loaded:
        served = fs.stats()["bytes"]
        assert {(s.backend, s.storage) for s in loaded.stats} == {("cooperative", "fuse")}
        assert "fuse:" in loaded.summary() and "in flight" in loaded.summary()
        full = reference_tensors(llama_dir)
        for rank in range(tp):
            shards, want = loaded.get(rank), expected_rank(full, cfg, rank, tp)
            assert shards.keys() == want.keys()
            for name, t in want.items():
                assert torch.equal(shards[name], t), (rank, name)
        union = sum(n.nbytes for n in loaded.plan.nodes)
    headers = sum(header_bytes(os.path.join(llama_dir, os.path.basename(f.uri))) for f in loaded.plan.files)
    probe = probe_bytes(llama_dir)  # this process's first look at the mount
    assert union <= served <= 1.02 * union + (1 + tp) * headers + probe, (served, union, headers, probe)
