"""raylazy.core.header accepts what safetensors writes, and reads it as safetensors does."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import pytest
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raylazy.core.dtypes import DTYPE_BITS
from raylazy.core.header import parse_header
from raylazy.storage import read_header
from tests.support.headers import T2, build, check_against_reference, entry, write

TORCH_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


def _random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.complex64:
        return torch.randn(shape, generator=g, dtype=torch.complex64)
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g, dtype=torch.int64).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("with_metadata", [False, True])
def test_matches_safetensors_on_save_file_output(tmp_path, with_metadata):
    shapes = [(3, 5), (7,), (), (2, 3, 4), (0, 4), (1,), (11, 2)]
    tensors = {
        f"t{i}.{name.lower()}": _random_tensor(dt, shapes[i % len(shapes)], i)
        for i, (name, dt) in enumerate(TORCH_DTYPES.items())
    }
    path = str(tmp_path / "st.safetensors")
    metadata = {"format": "pt", "note": "é ✓"} if with_metadata else None
    save_file(tensors, path, metadata=metadata)
    header = read_header(path)
    check_against_reference(path, header)
    raw = open(path, "rb").read()
    for t in header.tensors:
        assert t.dtype == next(k for k, v in TORCH_DTYPES.items() if v == tensors[t.name].dtype)
        assert raw[t.start : t.end] == tensors[t.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert (dict(header.metadata) if header.metadata is not None else None) == metadata


@pytest.mark.parametrize("metadata", [None, {"format": "pt", "note": "é ✓"}, {}])
def test_headers_as_safetensors_writes_them_read_as_their_json(monkeypatch, metadata):
    """save_file's headers (compact, the metadata first, padded with spaces) are read without the JSON parser
    (`_written_header`) into exactly what the JSON path reads; the same header spelled otherwise (the metadata
    last, spaces after the separators, an entry's fields in another order, the entries out of offset order) is
    not of that form, and still read."""
    from raylazy.core import header as h

    tensors = {f"model.layers.{i}.w{i}": _random_tensor(dt, shape, i) for i, (dt, shape) in
               enumerate([(torch.bfloat16, (3, 5)), (torch.float32, (7,)), (torch.int8, ()), (torch.float16, (2, 3, 4))])}
    blob = safetensors.torch.save(tensors, metadata=metadata)
    n = int.from_bytes(blob[:8], "little")
    raw = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    entries = {k: v for k, v in raw.items() if k != "__metadata__"}
    variants = [blob, build({**entries, "__metadata__": raw.get("__metadata__", {})}, data),
                build(json.dumps(raw), data),
                build({k: {"shape": v["shape"], "dtype": v["dtype"], "data_offsets": v["data_offsets"]}
                       for k, v in entries.items()}, data),
                build(dict(reversed(entries.items())), data)]
    for i, b in enumerate(variants):
        k = int.from_bytes(b[:8], "little")
        written = h._written_header(b[8 : 8 + k], b[8 : 8 + k].decode(), 8 + k)
        assert (written is not None) == (i == 0), i
        fast = parse_header(b, len(b))
        with monkeypatch.context() as m:
            m.setattr(h, "_written_header", lambda *a: None)
            assert parse_header(b, len(b)) == fast, i
        assert [(t.name, t.dtype, t.shape) for t in fast.tensors] == [
            (name, v["dtype"], tuple(v["shape"])) for name, v in sorted(entries.items(), key=lambda e: e[1]["data_offsets"])]


def test_parse_header_equals_read_header(tmp_path):
    path = str(tmp_path / "st.safetensors")
    save_file({"a": torch.randn(4, 4), "b": torch.arange(6, dtype=torch.int32)}, path, metadata={"k": "v"})
    raw = open(path, "rb").read()
    from_file = read_header(path)
    n = struct.unpack("<Q", raw[:8])[0]
    from_bytes = parse_header(raw[: 8 + n], len(raw), path)
    assert from_bytes == from_file
    assert parse_header(raw, len(raw), path) == from_file  # extra data after the header is ignored


@pytest.mark.parametrize(
    "lead, trail", [("", "   "), ("  ", ""), ("\n\t ", "\r\n"), (" " * 13, " " * 7)], ids=["trail", "lead", "mixed", "both"]
)
def test_whitespace_padding(tmp_path, lead, trail):
    header = {"__metadata__": {"format": "pt"}, "a": entry("F32", [2], 0, 8), "b": entry("U8", [3], 8, 11)}
    data = bytes(range(11))
    unpadded = build(header, data)
    plain = parse_header(unpadded, len(unpadded))
    text = lead + json.dumps(header, separators=(",", ":")) + trail
    path = write(tmp_path, build(text, data))
    padded = read_header(path)
    assert padded.header_len == len(text)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in padded.tensors] == [
        (t.name, t.dtype, t.shape, t.nbytes) for t in plain.tensors
    ]
    assert padded.tensors[0].start == 8 + len(text)
    check_against_reference(path, padded)


@pytest.mark.parametrize("residue", range(8))
def test_header_not_8_byte_aligned(tmp_path, residue):
    for pad_name in range(64):
        header = {"n" * (pad_name + 1): entry("F32", [3], 0, 12), "z": entry("I16", [2], 12, 16)}
        if len(json.dumps(header, separators=(",", ":"))) % 8 == residue:
            break
    blob = build(header, os.urandom(16))
    assert (len(blob) - 16) % 8 == residue
    path = write(tmp_path, blob)
    h = read_header(path)
    assert h.data_start % 8 == residue
    check_against_reference(path, h)


def test_scalar_tensor(tmp_path):
    value = struct.pack("<f", 3.25)
    path = write(tmp_path, build({"s": entry("F32", [], 0, 4)}, value))
    h = read_header(path)
    (t,) = h.tensors
    assert t.shape == () and t.nbytes == 4
    check_against_reference(path, h)
    with safe_open(path, framework="pt") as f:
        assert f.get_tensor("s").item() == 3.25


@pytest.mark.parametrize("position", ["alone", "first", "middle", "last", "several"])
def test_zero_size_tensors(tmp_path, position):
    a, b = entry("U8", [3], 0, 3), entry("F16", [2], 3, 7)
    layouts = {
        "alone": {"z": entry("F32", [0, 5], 0, 0)},
        "first": {"z": entry("F32", [0], 0, 0), "a": a, "b": b},
        "middle": {"a": a, "z": entry("BF16", [4, 0], 3, 3), "b": b},
        "last": {"a": a, "b": b, "z": entry("I64", [0], 7, 7)},
        "several": {"a": a, "y": entry("U8", [0], 3, 3), "z": entry("U8", [0, 0], 3, 3), "b": b},
    }
    header = layouts[position]
    data = b"" if position == "alone" else bytes(range(7))
    path = write(tmp_path, build(header, data))
    h = read_header(path)
    assert {t.name for t in h.tensors} == set(header)
    for t in h.tensors:
        if 0 in t.shape:
            assert t.start == t.end
    check_against_reference(path, h)


def _whole_byte_count(bits: int) -> int:
    """The smallest element count whose bits are a whole number of bytes."""
    return 8 // math.gcd(bits, 8)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_dtype(tmp_path, dtype):
    bits = DTYPE_BITS[dtype]
    k = _whole_byte_count(bits)
    shape = [3, 2 * k]  # whole bytes, and more than one byte
    nbytes = 3 * 2 * k * bits // 8
    header = {"lead": entry("U8", [1], 0, 1), "w": entry(dtype, shape, 1, 1 + nbytes)}
    data = os.urandom(1 + nbytes)
    path = write(tmp_path, build(header, data))
    h = read_header(path)
    w = {t.name: t for t in h.tensors}["w"]
    assert (w.dtype, w.shape, w.nbytes) == (dtype, tuple(shape), nbytes)
    assert open(path, "rb").read()[w.start : w.end] == data[1:]
    check_against_reference(path, h)


def test_dtype_table_matches_safetensors():
    """safetensors accepts every dtype raylazy knows, with the same size."""
    for dtype, bits in DTYPE_BITS.items():
        k = _whole_byte_count(bits)
        blob = build({"w": entry(dtype, [k], 0, k * bits // 8)}, b"\0" * (k * bits // 8))
        ((_, info),) = safetensors.deserialize(blob)
        assert info["dtype"] == dtype and len(info["data"]) == k * bits // 8


def test_metadata_null_and_empty_and_extra_entry_keys(tmp_path):
    # All accepted by safetensors 0.8 (checked in check_against_reference).
    for text in [
        '{"__metadata__":null,"a":%s}' % json.dumps(T2),
        '{"__metadata__":{},"a":%s}' % json.dumps(T2),
        '{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":{"x":[1,2.5,null]},"y":"z"}}',
        '{"__metadata__":null}',
        "{}",
    ]:
        data = b"" if '"a"' not in text else b"xy"
        path = write(tmp_path, build(text, data))
        h = read_header(path)
        check_against_reference(path, h)
        if "__metadata__\":null" in text:
            assert h.metadata is None
        elif "__metadata__\":{}" in text:
            assert dict(h.metadata) == {}


def test_header_fields(tmp_path):
    header = {"__metadata__": {"a": "b"}, "y": entry("F32", [2, 2], 16, 32), "x": entry("I64", [2], 0, 16)}
    blob = build(header, bytes(32))
    path = write(tmp_path, blob)
    h = read_header(path)
    n = len(blob) - 32
    assert h.path == path and h.file_size == len(blob) and h.header_len == n - 8 and h.data_start == n
    assert [t.name for t in h.tensors] == ["x", "y"]  # file order, not header order
    assert (h.tensors[1].start, h.tensors[1].end) == (n + 16, n + 32)
    assert dict(h.metadata) == {"a": "b"}
    with pytest.raises(TypeError):
        h.metadata["a"] = "c"  # read-only view
    assert h.digest == hashlib.sha256(blob[:n]).hexdigest()
    # The digest changes with any byte of the header, and not with the data.
    other = bytearray(blob)
    other[-1] ^= 0xFF
    assert parse_header(bytes(other), len(other)).digest == h.digest
    other = build({**header, "__metadata__": {"a": "c"}}, bytes(32))
    assert parse_header(other, len(other)).digest != h.digest


def test_unicode_tensor_names(tmp_path):
    names = ["é.weight", "层.0", "a b", "emoji😀", ""]
    header, off = {}, 0
    for i, name in enumerate(names):
        header[name] = entry("U8", [i + 1], off, off + i + 1)
        off += i + 1
    path = write(tmp_path, build(json.dumps(header), bytes(off)))  # json.dumps escapes non-ASCII
    h = read_header(path)
    assert {t.name for t in h.tensors} == set(names)
    check_against_reference(path, h)
    path = write(tmp_path, build(json.dumps(header, ensure_ascii=False), bytes(off)), "utf8.safetensors")
    check_against_reference(path, read_header(path))


