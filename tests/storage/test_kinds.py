"""Storage kinds (raylazy.storage.kinds): recorded mount tables and statfs magic numbers of the file systems these
machines do not have, named as their documentation names them; and the real ones here (the temporary directory,
/dev/shm, the emulated network mount in both modes) recognised from this process's own mount table, into the plan
and its summary."""

from __future__ import annotations

import os

import pytest

import raylazy
from raylazy.core.plans import Plan
from raylazy.storage import LocalStorage, storage_for
from raylazy.storage.kinds import (
    MAGIC,
    kernel_shape,
    kind_of,
    mount_of,
    parse_mountinfo,
    statfs_type,
    storage_kind,
)

#: Mount tables as the kernel writes them (/proc/self/mountinfo), one line per system, from hosts that have them.
RECORDED = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
31 27 0:27 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24683652k
98 27 0:45 / /mnt/efs rw,relatime shared:50 - nfs4 fs-0123abcd.efs.us-east-1.amazonaws.com:/ rw,vers=4.1,rsize=1048576,wsize=1048576,namlen=255,hard,noresvport,proto=tcp,timeo=600,retrans=2,sec=sys
99 27 0:46 / /mnt/filestore rw,relatime - nfs 10.0.0.2:/vol1 rw,vers=3,rsize=1048576,wsize=1048576,hard,proto=tcp
100 27 0:47 / /lustre/scratch rw,relatime - lustre 10.1.0.1@o2ib:/scratch rw,flock,lazystatfs,encrypt
101 27 0:48 / /gpfs/fs0 rw,relatime - gpfs fs0 rw
102 27 0:49 / /mnt/beegfs rw,relatime - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf
103 27 0:50 / /mnt/cephfs rw,relatime - ceph 10.0.0.3:6789,10.0.0.4:6789:/ rw,name=admin,secret=<hidden>,acl
104 27 0:51 / /mnt/gcs rw,nosuid,nodev,relatime - fuse.gcsfuse my-bucket rw,user_id=0,group_id=0,default_permissions
105 27 0:53 / /mnt/s3 rw,nosuid,nodev,noatime - fuse mountpoint-s3 rw,user_id=0,group_id=0,default_permissions
106 27 0:54 / /jfs rw,relatime - fuse.juicefs JuiceFS:myjfs rw,user_id=0,group_id=0,default_permissions,allow_other
107 27 0:55 / /mnt/blob rw,nosuid,nodev,relatime - fuse blobfuse2 rw,user_id=0,group_id=0
108 27 0:56 / /mnt/host rw,relatime - 9p hostshare rw,sync,dirsync,access=client,trans=virtio
109 27 0:57 / /mnt/host-cached rw,relatime - 9p hostshare2 rw,access=client,trans=virtio,cache=loose
110 27 0:58 / /mnt/virtio rw,relatime - virtiofs myfs rw
111 27 0:59 / /mnt/smb rw,relatime - cifs //server/share rw,vers=3.1.1,cache=strict,username=u
112 27 254:16 / /data rw,noatime - xfs /dev/nvme0n1 rw,attr2,inode64,logbufs=8
113 112 0:60 / /data/models\\040v2 rw,relatime - nfs4 server:/models rw,vers=4.2
114 27 0:61 / /mnt/efs rw,relatime - nfs4 fs-0123abcd.efs.us-east-1.amazonaws.com:/other rw,vers=4.1
115 27 0:62 / /mnt/sshfs rw,relatime - fuse.sshfs user@host:/srv rw,user_id=0,group_id=0
"""

#: path -> (kind, file-system type, network, page cache shared, mount point)
EXPECTED = {
    "/home/u/model": ("local", "ext4", False, True, "/"),
    "/dev/shm/ckpt": ("tmpfs", "tmpfs", False, True, "/dev/shm"),
    "/mnt/filestore/llama/model.safetensors": ("nfs", "nfs", True, True, "/mnt/filestore"),
    "/lustre/scratch/models": ("lustre", "lustre", True, True, "/lustre/scratch"),
    "/gpfs/fs0/m": ("gpfs", "gpfs", True, True, "/gpfs/fs0"),
    "/mnt/beegfs/m": ("beegfs", "beegfs", True, False, "/mnt/beegfs"),
    "/mnt/cephfs/m": ("cephfs", "ceph", True, True, "/mnt/cephfs"),
    "/mnt/gcs/llama": ("gcsfuse", "fuse.gcsfuse", True, True, "/mnt/gcs"),
    "/mnt/s3/llama": ("mountpoint-s3", "fuse", True, False, "/mnt/s3"),
    "/jfs/llama": ("juicefs", "fuse.juicefs", True, True, "/jfs"),
    "/mnt/blob/x": ("blobfuse2", "fuse", True, True, "/mnt/blob"),
    "/mnt/host/x": ("9p", "9p", True, False, "/mnt/host"),  # 9p's default: cache=none
    "/mnt/host-cached/x": ("9p", "9p", True, True, "/mnt/host-cached"),
    "/mnt/virtio/x": ("virtiofs", "virtiofs", True, True, "/mnt/virtio"),
    "/mnt/smb/x": ("smb", "cifs", True, True, "/mnt/smb"),
    "/data/models": ("local", "xfs", False, True, "/data"),  # not /data/models v2: a prefix of names is no parent
    "/data/models v2/llama": ("nfs", "nfs4", True, True, "/data/models v2"),  # \040 in the table
    "/mnt/efs/x": ("nfs", "nfs4", True, True, "/mnt/efs"),  # two mounts on /mnt/efs: the later one covers it
    "/mnt/sshfs/x": ("sshfs", "fuse.sshfs", True, True, "/mnt/sshfs"),
    "/mnt/smbx/x": ("local", "ext4", False, True, "/"),
}


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_recorded_mount_tables_name_the_kind(path):
    mounts = parse_mountinfo(RECORDED)
    mount = mount_of(path, mounts)
    kind = kind_of(mount.fs_type, mount.options, mount.mount_point, mount.source)
    assert (kind.name, kind.fs_type, kind.network, kind.page_cache, kind.mount_point) == EXPECTED[path]


#: A container's mount table: its root an overlay of image layers, the checkpoint bind-mounted from the host.
CONTAINER = """\
401 380 0:52 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/A:/var/lib/docker/overlay2/l/B,upperdir=/var/lib/docker/overlay2/x/diff,workdir=/var/lib/docker/overlay2/x/work
402 401 0:53 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
410 401 254:16 /models /models ro,noatime - xfs /dev/nvme0n1 rw,attr2,inode64
"""


def test_a_containers_root_is_overlay_and_its_bind_mount_the_hosts_disk():
    mounts = parse_mountinfo(CONTAINER)
    root, models = mount_of("/srv/app", mounts), mount_of("/models/llama", mounts)
    assert kind_of(root.fs_type, root.options, root.mount_point).name == "overlay"
    assert (models.fs_type, models.mount_point, kind_of(models.fs_type).name) == ("xfs", "/models", "local")


def test_stacked_mounts_the_later_one_covers_the_earlier():
    assert mount_of("/mnt/efs/x", parse_mountinfo(RECORDED)).source.endswith(":/other")


def test_smb_uncached_and_a_probed_fuse_mount_share_no_pages():
    assert not kind_of("cifs", frozenset({"cache=none"})).page_cache
    assert not kind_of("fuse.juicefs", direct_io=True).page_cache  # a mount that turned direct_io on
    assert kind_of("fuse", source="mountpoint-s3", direct_io=False).page_cache  # ... or was given a cache


#: statfs f_type -> (kind, network, page cache shared): the magic numbers of linux/magic.h and the file systems'
#: own headers, where the mount table cannot be read.
STATFS = {0xEF53: ("local", False, True), 0x58465342: ("local", False, True), 0x9123683E: ("local", False, True),
          0x01021994: ("tmpfs", False, True), 0x794C7630: ("overlay", False, True), 0x6969: ("nfs", True, True),
          0x0BD00BD0: ("lustre", True, True), 0x47504653: ("gpfs", True, True), 0x19830326: ("beegfs", True, False),
          0x00C36400: ("cephfs", True, True), 0x65735546: ("fuse", True, True), 0x01021997: ("9p", True, False),
          0xFF534D42: ("smb", True, True)}


@pytest.mark.parametrize("magic", sorted(STATFS))
def test_statfs_magic_numbers_name_the_kind(magic):
    kind = kind_of(MAGIC[magic])
    assert (kind.name, kind.network, kind.page_cache) == STATFS[magic]


@pytest.mark.parametrize("where", ["tmp", "/dev/shm"])
def test_this_machine_agrees_with_its_statfs(tmp_path, where):
    """The mount table's answer for a real directory is the kind its statfs magic number names."""
    path = str(tmp_path) if where == "tmp" else where
    if not os.path.isdir(path):
        pytest.skip(f"no {path} here")
    kind = storage_kind(path)
    assert kind == LocalStorage().kind(path)
    assert kind.name == kind_of(MAGIC[statfs_type(path)]).name
    assert not kind.network and kind.page_cache
    assert (kind.name == "tmpfs") == (where == "/dev/shm" or statfs_type(path) == 0x01021994)


@pytest.mark.parametrize("mode", ["cached", "direct"])
def test_the_emulated_mount_is_a_network_fuse_mount_and_the_plan_says_so(netfs, llama_dir, mode):
    fs = netfs(llama_dir, mode=mode)
    kind = storage_kind(fs.mountpoint)
    assert (kind.name, kind.fs_type, kind.network, kind.mount_point) == (
        "fuse", "fuse.raylazy-netfs", True, os.path.realpath(fs.mountpoint))
    assert kind.page_cache == (mode == "cached")  # direct_io: a checkpoint file refuses a shared map
    plan = raylazy.plan(fs.mountpoint, tp=2)
    assert plan.storage == kind
    assert f"storage: {kind.describe()}" in plan.summary().splitlines()
    assert Plan.from_json(plan.to_json()).storage == kind
    with storage_for(fs.path("config.json")).open(plan.files[0].uri) as source:
        assert source.cached == (mode == "cached")  # no read-ahead hints where nothing is kept
    assert raylazy.plan(llama_dir, tp=2).storage == storage_kind(llama_dir)


def test_the_kernel_says_the_request_size_and_depth_of_nfs_and_fuse_mounts(tmp_path):
    """NFS: its READs are `rsize` (the mount table); FUSE: a buffered read's requests are the mount's read-ahead
    (its bdi in sysfs), at most `max_read` where the mount sets it, and the connection keeps `max_background`
    requests in flight (/sys/fs/fuse/connections/MINOR); served with direct_io, its reads go as asked. Where sysfs
    says nothing, nothing is assumed."""
    (tmp_path / "class/bdi/0:62").mkdir(parents=True)
    (tmp_path / "class/bdi/0:62/read_ahead_kb").write_text("128\n")
    (tmp_path / "fs/fuse/connections/62").mkdir(parents=True)
    (tmp_path / "fs/fuse/connections/62/max_background").write_text("12\n")
    mounts = {m.mount_point: m for m in parse_mountinfo(RECORDED)}
    assert kernel_shape(mounts["/mnt/efs"], False, sysfs=str(tmp_path)) == (0, 0)  # the later /mnt/efs: no rsize
    assert kernel_shape(mounts["/mnt/filestore"], False, sysfs=str(tmp_path)) == (1 << 20, 0)
    sshfs = mounts["/mnt/sshfs"]
    assert kernel_shape(sshfs, True, sysfs=str(tmp_path)) == (128 << 10, 12)
    assert kernel_shape(sshfs._replace(options=sshfs.options | {"max_read=65536"}), True, sysfs=str(tmp_path)) == (
        64 << 10, 12)
    assert kernel_shape(sshfs, True, cached=False, sysfs=str(tmp_path)) == (0, 0)  # direct_io: reads as asked
    assert kernel_shape(mounts["/mnt/gcs"], True, sysfs=str(tmp_path)) == (0, 0)  # 0:51: nothing in this sysfs


def test_the_emulated_mounts_requests_are_the_size_the_kernel_says(netfs, tmp_path):
    """On a live FUSE mount with read-ahead 256 KiB: the kind's request size is 256 KiB and the storage's figures
    use it; a cold read of a file through the mount reaches the server (its own count) in requests of that size."""
    (tmp_path / "blob").write_bytes(os.urandom(8 << 20))
    fs = netfs(str(tmp_path), mode="cached", read_ahead_kb=256)
    kind = storage_kind(fs.mountpoint)
    assert kind.request_bytes == 256 << 10 and kind.depth > 0
    costs = storage_for(fs.mountpoint).cost_model(fs.mountpoint, kind)
    assert (costs.part_bytes, costs.concurrency) == (kind.request_bytes, kind.depth)
    fs.reset()
    with open(fs.path("blob"), "rb") as f:
        while f.read(4 << 20):
            pass
    stats = fs.stats()
    assert stats["bytes"] == 8 << 20 and stats["bytes"] / stats["requests"] == kind.request_bytes, stats


def test_object_storage_is_a_network_store_without_page_cache():
    pytest.importorskip("obstore")
    kind = storage_for("s3://bucket/model", {"endpoint": "http://127.0.0.1:1", "allow_http": "true"}).kind(
        "s3://bucket/model")
    assert (kind.name, kind.fs_type, kind.network, kind.page_cache) == ("object", "s3", True, False)
