"""raylazy.storage: the local implementation's contract, the scheme registry, and a whole plan + read
through a second storage (an in-memory one registered as `mem://`), bit-for-bit against safetensors."""

from __future__ import annotations

import os

import pytest

import raylazy.io.fst as fst
import raylazy.storage
from raylazy.core.options import ReaderOptions
from raylazy.errors import ConfigurationError, UnsupportedStorageError
from raylazy.io.ranged import read_rank_ranged
from raylazy.planning import make_plan
from raylazy.storage import (
    LocalStorage,
    NotAFileError,
    Source,
    Storage,
    local_path,
    open_checkpoint,
    register_storage,
    storage_for,
)
from tests.support.checkpoints import reference_tensors, shard_files
from tests.support.planlib import as_bytes, reference_shard


class MemSource(Source):
    def __init__(self, uri: str, data: bytes):
        self.uri, self.data, self.size, self.calls = uri, data, len(data), 0

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]

    def readinto(self, offset: int, buffers) -> None:
        self.calls += 1
        for b in buffers:
            chunk = self.data[offset : offset + len(b)]
            if len(chunk) < len(b):
                raise EOFError(f"{len(b) - len(chunk)} bytes missing at offset {offset + len(chunk)}")
            b[:] = chunk
            offset += len(b)

    def close(self) -> None:
        pass


class MemStorage(Storage):
    """Files held in a dict: what an object store module would provide, minus the network."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.opened = files, []

    def open(self, uri: str) -> MemSource:
        if uri not in self.files:
            raise FileNotFoundError(2, "No such object", uri)
        self.opened.append(uri)
        return MemSource(uri, self.files[uri])

    def list(self, uri: str) -> list[str]:
        prefix = uri.rstrip("/") + "/"
        return sorted({k[len(prefix):].split("/")[0] for k in self.files if k.startswith(prefix)})

    def exists(self, uri: str) -> bool:
        return self.is_file(uri) or self.is_dir(uri)

    def is_file(self, uri: str) -> bool:
        return uri in self.files

    def is_dir(self, uri: str) -> bool:
        return any(k.startswith(uri.rstrip("/") + "/") for k in self.files)


@pytest.fixture
def mem_llama(llama_dir, monkeypatch):
    files = {}
    for name in os.listdir(llama_dir):
        with open(os.path.join(llama_dir, name), "rb") as f:
            files[f"mem://bucket/llama/{name}"] = f.read()
    storage = MemStorage(files)
    for registry in ("_FACTORIES", "_STORAGES"):  # registered for this test only
        monkeypatch.setattr(raylazy.storage.registry, registry, dict(getattr(raylazy.storage.registry, registry)))
    register_storage("mem", lambda: storage)
    return storage


def test_plan_and_read_through_another_storage(mem_llama, llama_dir):
    plan = make_plan("mem://bucket/llama", 2)
    assert plan.root == "mem://bucket/llama" and plan.model_type == "llama"
    assert [f.uri for f in plan.files] == [f"mem://bucket/llama/{n}" for n in shard_files(llama_dir)]
    assert [rp.tensors for rp in plan.ranks] == [rp.tensors for rp in make_plan(llama_dir, 2).ranks]
    assert set(mem_llama.opened) >= {f.uri for f in plan.files}  # headers came through the storage
    full = reference_tensors(llama_dir)
    for rp in plan.ranks:
        for stage in (False, True):
            shards, stats = read_rank_ranged(rp, "cpu", options=ReaderOptions(chunk_bytes=4096), stage=stage)
            for t in rp.tensors:
                assert as_bytes(shards[t.name]) == as_bytes(reference_shard(full[t.name], t)), t.name
            assert stats.bytes_needed == rp.stats.bytes_needed
    with pytest.raises(ConfigurationError, match="local files only"):
        fst.read_rank_fastsafetensors(plan.ranks[0], "cpu", options=ReaderOptions(backend="fastsafetensors"))


def test_unknown_scheme_is_a_named_error():
    with pytest.raises(UnsupportedStorageError, match="'nosuch'.*register_storage"):
        open_checkpoint("nosuch://bucket/model")
    assert isinstance(storage_for("/a/b"), LocalStorage) and isinstance(storage_for("file:///a/b"), LocalStorage)
    assert storage_for("C:\\models\\x") is storage_for("relative/dir")  # no scheme: local


def test_file_uri_plans_as_a_plain_path(llama_dir):
    plan = make_plan("file://" + llama_dir, 2)
    assert plan == make_plan(llama_dir, 2)
    assert local_path("file:///x/y") == "/x/y" and local_path("/x/y") == "/x/y" and local_path("s3://b/k") is None


def test_local_source_reads_exactly_and_refuses_non_files(tmp_path):
    path = str(tmp_path / "f.bin")
    data = bytes(range(256)) * 64
    with open(path, "wb") as f:
        f.write(data)
    local = storage_for(path)
    with local.open(path) as src:
        assert src.size == len(data) and src.uri == path
        assert src.read(10, 5) == data[10:15] and src.read(len(data) - 3, 100) == data[-3:]
        a, b = bytearray(7), bytearray(300)
        src.readinto(1000, [memoryview(a), memoryview(b)])
        assert bytes(a + b) == data[1000:1307]
        rows = [bytearray(3) for _ in range(3000)]  # more buffers than one preadv takes (IOV_MAX, 1024 on Linux)
        src.readinto(5, [memoryview(r) for r in rows])
        assert b"".join(rows) == data[5:9005]
        src.random_access()
        src.will_need(0, len(data))
        c = bytearray(100)
        got = src.try_readinto(0, memoryview(c))  # just written: cached, or 0 where RWF_NOWAIT is missing
        assert got in (0, 100) and bytes(c[:got]) == data[:got]
        with pytest.raises(EOFError):
            src.readinto(len(data) - 10, [memoryview(bytearray(11))])
    with pytest.raises(OSError):
        src.readinto(0, [memoryview(bytearray(1))])  # closed
    os.mkfifo(str(tmp_path / "fifo"))
    for other in (str(tmp_path), str(tmp_path / "fifo"), "/dev/zero"):
        with pytest.raises(NotAFileError):
            local.open(other)
    with pytest.raises(FileNotFoundError):
        local.open(str(tmp_path / "missing"))
