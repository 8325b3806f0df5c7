"""Holders of a checkpoint in Ray (`raylazy.hold`), on the emulated network mount in its `direct` mode (every read
a request the mount counts): the mount serves each byte of the checkpoint once for the holder, and loads from it
read nothing but headers; shards taken from it equal safetensors' tensors narrowed (`check_loaded`); a checkpoint
changed since it was held is never served; a holder over its budget is refused before a byte is read and leaves
nothing; a holder gone before a load leaves the load to read storage; a second node's holder copies the first's
through Ray, the mount serving nothing more."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import raylazy
from raylazy.cluster.holder import HeldModel, find
from raylazy.errors import HolderFullError, StaleHolderError
from tests.support import REPO
from tests.support.checkpoints import file_bytes, header_bytes, probe_bytes
from tests.support.raytest import check_loaded, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def mounted(llama_dir, netfs, tmp_path):
    """A copy of the Llama checkpoint on the emulated mount in its `direct` mode, and its holders released after."""
    src = shutil.copytree(llama_dir, tmp_path / "ckpt")
    fs = netfs(str(src), mode="direct", attr_timeout_s=0.0)  # a file rewritten under it shows at once
    yield fs
    for info in raylazy.holders():
        if info.root.startswith(fs.mountpoint):
            find(info.root).release()


def test_loads_from_a_holder_read_storage_once_and_get_safetensors_bytes(ray_local, mounted):
    path, size, head = mounted.mountpoint, file_bytes(mounted.source), header_bytes(mounted.source)
    probe = probe_bytes(mounted.source)  # a process's first look at the mount (`raylazy.storage.probe`)
    held = raylazy.hold(path)
    filled = mounted.served()
    # the data once; the headers: the driver's discovery and the holder's check before reading (within three); the
    # holder's probe
    assert size <= filled <= size + 3 * head + probe, (filled, size, head, probe)
    assert [i.nbytes for i in held.infos()] == [size] and held.infos()[0].filled_from == "storage"
    for tp, replicas in ((1, 1), (2, 1), (2, 2)):
        with raylazy.load(source=held, tp=tp, replicas=replicas) as loaded:
            check_loaded(loaded, mounted.source)
            assert {s.backend for s in loaded.stats} == {"holder"}
            assert sum(s.bytes_from_holder for s in loaded.stats) == sum(s.bytes_needed for s in loaded.stats) > 0
    # each load's plan read the headers, the first's probed the mount too (the driver's), and no rank read a byte
    # (a rank's rchar would count Ray's socket reads too)
    assert mounted.served() - filled == 3 * head + probe
    again = raylazy.hold(path)  # held as it is: not read again
    assert again.actors.keys() == held.actors.keys() and mounted.served() - filled == 4 * head + probe


def test_a_checkpoint_changed_since_it_was_held_is_never_served(ray_local, mounted):
    path = mounted.mountpoint
    held = raylazy.hold(path)
    shard = os.path.join(mounted.source, sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))[0])
    with open(shard, "r+b") as f:  # new weights, the same header: its last bf16 element becomes 1.0
        f.seek(-2, os.SEEK_END)
        f.write(b"\x80\x3f")
    with pytest.raises(StaleHolderError, match="hold it again"):
        raylazy.load(source=held, tp=2)
    before = mounted.served()
    fresh = raylazy.hold(path)  # held afresh: read again, then served
    assert fresh.identity != held.identity and mounted.served() - before >= file_bytes(mounted.source)
    with raylazy.load(source=fresh, tp=2) as loaded:
        check_loaded(loaded, mounted.source)
        assert {s.backend for s in loaded.stats} == {"holder"}


def test_a_holder_over_its_budget_is_refused_before_reading_and_leaves_nothing(ray_local, mounted):
    before = mounted.served()
    with pytest.raises(HolderFullError, match="budget"):
        raylazy.hold(mounted.mountpoint, budget_bytes=file_bytes(mounted.source) - 1)
    assert mounted.served() - before <= 2 * header_bytes(mounted.source)  # discovery only: no data
    wait_for(lambda: not [i for i in raylazy.holders() if i.root == mounted.mountpoint], 30, "no holder left")


def test_a_load_whose_holder_is_gone_reads_storage(ray_local, mounted, caplog):
    path = mounted.mountpoint
    held = raylazy.hold(path)
    HeldModel(held.root, held.identity, dict(held.actors)).release()  # released elsewhere, not through `held`
    wait_for(lambda: not raylazy.holders(), 30, "the holder to go")
    before = mounted.served()
    with caplog.at_level("WARNING", logger="raylazy"), raylazy.load(source=held, tp=2) as loaded:
        check_loaded(loaded, mounted.source)
        assert {s.backend for s in loaded.stats} != {"holder"} and mounted.served() - before >= loaded.plan.bytes_needed
    assert "could not copy their shards from a holder" in caplog.text and "from storage" in caplog.text


def test_an_idle_holder_releases_itself(ray_local, mounted):
    raylazy.hold(mounted.mountpoint, idle_s=1.0)
    wait_for(lambda: not [i for i in raylazy.holders() if i.root == mounted.mountpoint], 30, "the idle holder to go")


@pytest.mark.own_processes
def test_a_second_node_copies_the_first_nodes_holder_not_storage(two_node_cluster, mounted):
    import ray

    path, size = mounted.mountpoint, file_bytes(mounted.source)
    held = raylazy.hold(path)  # every alive node: this one reads, the other copies
    infos = {i.node_id: i for i in held.infos()}
    assert len(infos) == 2 and all(i.nbytes == size for i in infos.values())
    first = next(n for n, i in infos.items() if i.filled_from == "storage")
    assert [i.filled_from for n, i in infos.items() if n != first] == [first]
    assert mounted.served() <= size + 3 * header_bytes(mounted.source) + probe_bytes(mounted.source)  # its probe
    with raylazy.load(source=held, tp=4) as loaded:  # a logical GPU each: two per node
        check_loaded(loaded, mounted.source)
        assert len({r.node_id for r in loaded.ranks}) == 2 and {s.backend for s in loaded.stats} == {"holder"}
    # the command, from another process of the cluster: it lists both, and releases them
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=str(REPO))
    listed = subprocess.run([sys.executable, "-m", "raylazy.cli", "hold", "--list"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0 and listed.stdout.count(path) == 2, listed.stdout + listed.stderr
    released = subprocess.run([sys.executable, "-m", "raylazy.cli", "hold", path, "--release"], env=env,
                              capture_output=True, text=True, timeout=120)
    assert released.returncode == 0, released.stderr
    wait_for(lambda: not raylazy.holders(), 30, "the holders to go")


def test_chunks_taken_stay_the_files_bytes_after_their_holder_goes(ray_local, mounted):
    from raylazy.cluster.holder import take
    from raylazy.core.plans import FileRef
    from raylazy.storage import identity, open_checkpoint

    ckpt = open_checkpoint(mounted.mountpoint)
    held = raylazy.hold(mounted.mountpoint)
    chunks, _ = take(ckpt.root, identity(map(FileRef.of, ckpt.files)), 30)
    held.release()
    wait_for(lambda: not raylazy.holders(), 30, "the holder to go")
    for f, header in enumerate(ckpt.files):  # a load that mapped them finishes whatever happens to the holder
        with open(os.path.join(mounted.source, os.path.basename(header.path)), "rb") as src:
            assert chunks.source(f).read(0, header.file_size) == src.read()
