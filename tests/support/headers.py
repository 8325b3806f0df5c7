"""Safetensors files written byte by byte for the header tests, and the checks every one of them makes: both
readers (file and bytes) refuse a file with the same error, and an accepted file reads as safetensors reads it."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import safetensors
from safetensors import safe_open

from raylazy.core.header import FileHeader, parse_header
from raylazy.errors import (
    HeaderError,
)
from raylazy.storage import read_header


def build(header, data: bytes = b"") -> bytes:
    """A file: the 8-byte little-endian length, the header (dict, str or bytes), then data."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8")
    return struct.pack("<Q", len(header)) + header + data


def entry(dtype: str, shape, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def write(tmp_path, blob: bytes, name: str = "x.safetensors") -> str:
    path = tmp_path / name
    path.write_bytes(blob)
    return str(path)


def reject(tmp_path, blob: bytes, exc: type[HeaderError]) -> tuple[HeaderError, str]:
    """Both read_header (file) and parse_header (bytes) must refuse `blob` with `exc`.

    Returns read_header's exception and the path it was given.
    """
    path = write(tmp_path, blob)
    with pytest.raises(exc) as from_file:
        read_header(path)
    with pytest.raises(exc) as from_bytes:
        parse_header(blob, len(blob), "mem://blob")
    assert type(from_file.value) is exc, f"expected exactly {exc.__name__}, got {type(from_file.value).__name__}"
    assert type(from_bytes.value) is exc
    err = from_file.value
    assert err.path == path
    assert str(err).startswith(f"{path}: "), str(err)
    assert from_bytes.value.path == "mem://blob"
    # The message does not depend on how the bytes were read.
    assert from_bytes.value.detail == err.detail
    return err, path


def assert_mentions(err: Exception, *needles) -> None:
    msg = str(err)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in message: {msg}"


T2 = entry("U8", [2], 0, 2)  # a valid 2-byte tensor


def check_against_reference(path: str, header: FileHeader) -> None:
    """read_header's view of `path` matches safetensors': names, dtypes, shapes, bytes, metadata."""
    raw = open(path, "rb").read()
    assert header.file_size == len(raw)
    assert header.header_len == struct.unpack("<Q", raw[:8])[0]
    assert header.digest == hashlib.sha256(raw[: header.data_start]).hexdigest()
    ours = {t.name: t for t in header.tensors}
    assert len(ours) == len(header.tensors)
    ref = {name: info for name, info in safetensors.deserialize(raw)}
    assert set(ours) == set(ref)
    for name, info in ref.items():
        t = ours[name]
        assert t.dtype == info["dtype"], name
        assert list(t.shape) == list(info["shape"]), name
        assert raw[t.start : t.end] == bytes(info["data"]), name
        assert t.nbytes == len(info["data"])
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(ours)
        assert f.metadata() == (dict(header.metadata) if header.metadata is not None else None)
        for name in f.keys():
            s = f.get_slice(name)
            assert s.get_dtype() == ours[name].dtype
            assert list(s.get_shape()) == list(ours[name].shape)
    # In file order, without gaps, from the end of the header to the end of the file.
    starts = [t.start for t in header.tensors]
    assert starts == sorted(starts)
    pos = header.data_start
    for t in header.tensors:
        assert t.start == pos
        pos = t.end
    assert pos == header.file_size
