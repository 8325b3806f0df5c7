"""Tests of raylazy.core.header: every rejection rule, acceptance of what safetensors writes,
agreement with safetensors itself, and fuzzing that only RaylazyError ever escapes."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import pickle
import re
import struct
import sys

import pytest
import safetensors
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from raylazy import errors
from raylazy.core.dtypes import DTYPE_BITS, nbytes_of
from raylazy.core.header import MAX_HEADER_BYTES, FileHeader, parse_header
from raylazy.errors import (
    CheckpointError,
    DataLayoutError,
    DuplicateKeyError,
    FileSizeMismatchError,
    FileTooSmallError,
    HeaderEncodingError,
    HeaderError,
    HeaderJSONError,
    HeaderLengthError,
    MetadataError,
    PartialByteError,
    PartialByteTensorError,
    RaylazyError,
    TensorEntryError,
    TensorSizeError,
    UnknownDTypeError,
)
from raylazy.storage import read_header

# --- helpers -------------------------------------------------------------------


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


# --- the length prefix -----------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7])
def test_file_shorter_than_prefix(tmp_path, size):
    blob = bytes(range(1, size + 1))
    err, _ = reject(tmp_path, blob, FileTooSmallError)
    assert_mentions(err, f"{size} bytes", "8-byte")


@pytest.mark.parametrize("n", [MAX_HEADER_BYTES + 1, 2**32, 2**64 - 1])
def test_header_length_over_cap(tmp_path, n):
    blob = struct.pack("<Q", n) + b"{}"
    err, _ = reject(tmp_path, blob, HeaderLengthError)
    assert_mentions(err, n, MAX_HEADER_BYTES)


def test_header_length_at_cap_is_not_over_cap(tmp_path):
    # Exactly the cap is allowed by the cap rule; it only fails because the file is short.
    blob = struct.pack("<Q", MAX_HEADER_BYTES) + b"{}"
    err, _ = reject(tmp_path, blob, HeaderLengthError)
    assert "cap" not in err.detail and "runs past the end" in err.detail
    assert_mentions(err, MAX_HEADER_BYTES, f"{len(blob)}-byte")


@pytest.mark.parametrize("excess", [1, 2, 1000])
def test_header_length_past_eof(tmp_path, excess):
    text = b'{"__metadata__":{}}'
    blob = struct.pack("<Q", len(text) + excess) + text
    err, _ = reject(tmp_path, blob, HeaderLengthError)
    assert_mentions(err, len(text) + excess, f"{len(blob)}-byte")


# --- JSON ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, first_bad",
    [(b'{"a\xff":1}', 3), (b'{"a":"\xc3"}', 6), (b'{"\xed\xa0\x80":1}', 2), (b"\x80{}", 0), (b'{"\xf0\x9f\x98":2}', 2)],
    ids=["ff", "cut-2-byte", "utf8-surrogate", "continuation-first", "cut-4-byte"],
)
def test_invalid_utf8(tmp_path, text, first_bad):
    err, _ = reject(tmp_path, build(text), HeaderEncodingError)
    assert_mentions(err, f"byte {first_bad} of {len(text)}")


@pytest.mark.parametrize(
    "text",
    ['{"a": ', "", "   ", "{'a': 1}", '{"a":1,}', "{} {}", "{}\x00", "\ufeff{}", '{"a":01}', "{a:1}"],
    ids=["cut", "empty", "blank", "single-quotes", "trailing-comma", "two-values", "nul-pad", "bom", "octal", "bare-key"],
)
def test_not_json(tmp_path, text):
    err, _ = reject(tmp_path, build(text), HeaderJSONError)
    assert_mentions(err, "not valid JSON")


@pytest.mark.parametrize(
    "text, kind", [("[]", "list"), ('"abc"', "str"), ("12", "int"), ("null", "NoneType"), ("true", "bool")]
)
def test_json_not_an_object(tmp_path, text, kind):
    err, _ = reject(tmp_path, build(text), HeaderJSONError)
    assert_mentions(err, kind, "not an object")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("where", ["shape", "offset", "extra-key", "metadata"])
def test_nan_and_infinity(tmp_path, constant, where):
    texts = {
        "shape": f'{{"a":{{"dtype":"U8","shape":[{constant}],"data_offsets":[0,2]}}}}',
        "offset": f'{{"a":{{"dtype":"U8","shape":[2],"data_offsets":[0,{constant}]}}}}',
        "extra-key": f'{{"a":{{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":{constant}}}}}',
        "metadata": f'{{"__metadata__":{{"k":{constant}}},"a":{json.dumps(T2)}}}',
    }
    err, _ = reject(tmp_path, build(texts[where], b"xy"), HeaderJSONError)
    assert_mentions(err, constant)


@pytest.mark.parametrize(
    "text, key",
    [
        ('{"a":%s,"a":%s}' % (json.dumps(T2), json.dumps(T2)), "a"),
        ('{"a":{"dtype":"U8","shape":[2],"dtype":"U8","data_offsets":[0,2]}}', "dtype"),
        ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"data_offsets":[0,2]}}', "data_offsets"),
        ('{"__metadata__":{"k":"v","k":"v"},"a":%s}' % json.dumps(T2), "k"),
        ('{"__metadata__":{},"__metadata__":{},"a":%s}' % json.dumps(T2), "__metadata__"),
    ],
    ids=["top-level", "in-entry-dtype", "in-entry-offsets", "in-metadata", "metadata-twice"],
)
def test_duplicate_keys(tmp_path, text, key):
    err, _ = reject(tmp_path, build(text, b"xy"), DuplicateKeyError)
    assert_mentions(err, repr(key))


# --- tensor entries --------------------------------------------------------------


BAD_U64 = {  # JSON text
    "float": "2.0",
    "exp-float": "2e0",
    "true": "true",
    "false": "false",
    "negative": "-2",
    "2**64": str(2**64),
    "2**70": str(2**70),
    "string": '"2"',
    "null": "null",
    "list": "[2]",
}


@pytest.mark.parametrize("field", ["shape", "data_offsets[0]", "data_offsets[1]"])
@pytest.mark.parametrize("bad", list(BAD_U64), ids=list(BAD_U64))
def test_shape_and_offsets_must_be_u64(tmp_path, field, bad):
    value = BAD_U64[bad]
    shape, begin, end = "2", "0", "2"
    if field == "shape":
        shape = value
    elif field == "data_offsets[0]":
        begin = value
    else:
        end = value
    text = '{"w":{"dtype":"U8","shape":[%s],"data_offsets":[%s,%s]}}' % (shape, begin, end)
    err, _ = reject(tmp_path, build(text, b"xy"), TensorEntryError)
    assert_mentions(err, "'w'", field.split("[")[0], "2**64")
    if bad == "2**64":
        assert_mentions(err, 2**64)
    if bad == "negative":
        assert_mentions(err, -2)


@pytest.mark.parametrize(
    "offsets", [[2], [0, 2, 2], [], "0-2", {"0": 0, "1": 2}, 2, None], ids=["len1", "len3", "len0", "str", "dict", "int", "null"]
)
def test_data_offsets_shape(tmp_path, offsets):
    header = {"w": {"dtype": "U8", "shape": [2], "data_offsets": offsets}}
    err, _ = reject(tmp_path, build(header, b"xy"), TensorEntryError)
    assert_mentions(err, "'w'", "data_offsets", repr(offsets))


@pytest.mark.parametrize("shape", [2, "2", None, {"0": 2}], ids=["int", "str", "null", "dict"])
def test_shape_not_a_list(tmp_path, shape):
    header = {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 2]}}
    err, _ = reject(tmp_path, build(header, b"xy"), TensorEntryError)
    assert_mentions(err, "'w'", "shape", repr(shape))


@pytest.mark.parametrize("missing", ["dtype", "shape", "data_offsets"])
def test_entry_lacks_a_field(tmp_path, missing):
    e = dict(T2)
    del e[missing]
    err, _ = reject(tmp_path, build({"w": e}, b"xy"), TensorEntryError)
    assert_mentions(err, "'w'", "lacks", missing)


@pytest.mark.parametrize("value", [None, [], "U8", 3, True], ids=["null", "list", "str", "int", "bool"])
def test_entry_not_an_object(tmp_path, value):
    err, _ = reject(tmp_path, build({"w": value}), TensorEntryError)
    assert_mentions(err, "'w'", "not an object")


@pytest.mark.parametrize("dtype", ["Q4", "bf16", "FLOAT32", "F8", "", None, 16, ["F32"]])
def test_unknown_dtype(tmp_path, dtype):
    header = {"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 2]}}
    err, _ = reject(tmp_path, build(header, b"xy"), UnknownDTypeError)
    assert_mentions(err, "'w'", repr(dtype), "BF16")


@pytest.mark.parametrize(
    "metadata",
    [[], "format=pt", 3, True, {"k": 1}, {"k": None}, {"k": ["v"]}, {"k": {"a": "b"}}, {"ok": "v", "k": 1.5}],
    ids=["list", "str", "int", "bool", "int-value", "null-value", "list-value", "dict-value", "float-value"],
)
def test_metadata_not_strings(tmp_path, metadata):
    err, _ = reject(tmp_path, build({"__metadata__": metadata, "w": T2}, b"xy"), MetadataError)
    assert_mentions(err, "__metadata__")


def test_hole_between_tensors(tmp_path):
    header = {"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 4, 6)}
    err, _ = reject(tmp_path, build(header, b"x" * 6), DataLayoutError)
    assert_mentions(err, "'b'", "byte 4", "expected 2", "hole")


def test_hole_at_start(tmp_path):
    err, _ = reject(tmp_path, build({"a": entry("U8", [2], 3, 5)}, b"x" * 5), DataLayoutError)
    assert_mentions(err, "'a'", "byte 3", "expected 0", "hole")


@pytest.mark.parametrize(
    "b_offsets, culprit",
    [((1, 3), "'b'"), ((0, 2), None), ((0, 4), None)],
    ids=["partial", "identical", "containing"],
)
def test_overlapping_tensors(tmp_path, b_offsets, culprit):
    header = {"a": entry("U8", [2], 0, 2), "b": entry("U8", [b_offsets[1] - b_offsets[0]], *b_offsets)}
    err, _ = reject(tmp_path, build(header, b"x" * 4), DataLayoutError)
    assert_mentions(err, "overlap")
    if culprit:
        assert_mentions(err, culprit, f"byte {b_offsets[0]}", "expected 2")


def test_zero_size_tensor_inside_another_is_an_overlap(tmp_path):
    header = {"a": entry("U8", [4], 0, 4), "z": entry("U8", [0], 2, 2)}
    err, _ = reject(tmp_path, build(header, b"x" * 4), DataLayoutError)
    assert_mentions(err, "'z'", "byte 2", "expected 4", "overlap")


def test_end_before_begin(tmp_path):
    err, _ = reject(tmp_path, build({"w": entry("U8", [0], 4, 2)}, b"x" * 4), DataLayoutError)
    assert_mentions(err, "'w'", "[4, 2]")


@pytest.mark.parametrize(
    "dtype, shape, nbytes",
    [("F32", [2], 6), ("F32", [2], 12), ("BF16", [3, 4], 25), ("U8", [], 0), ("F32", [0], 4), ("F4", [4], 1)],
)
def test_byte_length_differs_from_shape(tmp_path, dtype, shape, nbytes):
    err, _ = reject(tmp_path, build({"w": entry(dtype, shape, 0, nbytes)}, b"x" * nbytes), TensorSizeError)
    need = nbytes_of(dtype, math.prod(shape))
    assert_mentions(err, "'w'", dtype, f"needs {need} bytes", f"hold {nbytes}", f"[0, {nbytes}]")


@pytest.mark.parametrize(
    "dtype, shape",
    [("U8", [2**32, 2**32]), ("F32", [2**62]), ("F64", [2**61]), ("U8", [2**63, 2**63, 2**63]), ("F4", [2**63, 4])],
)
def test_shape_product_overflows_64_bits(tmp_path, dtype, shape):
    err, _ = reject(tmp_path, build({"w": entry(dtype, shape, 0, 2)}, b"xy"), TensorSizeError)
    assert_mentions(err, "'w'", dtype, "overflows 64 bits", shape[0])


@pytest.mark.parametrize(
    "dtype, shape", [("F4", [3]), ("F4", [1]), ("F6_E2M3", [1]), ("F6_E3M2", [5]), ("F6_E2M3", [2, 3]), ("F4", [3, 3])]
)
def test_sub_byte_tensor_not_whole_bytes(tmp_path, dtype, shape):
    numel = math.prod(shape)
    nbytes = numel * DTYPE_BITS[dtype] // 8 + 1
    err, _ = reject(tmp_path, build({"w": entry(dtype, shape, 0, nbytes)}, b"x" * nbytes), PartialByteTensorError)
    assert isinstance(err, PartialByteError) and isinstance(err, CheckpointError) and not isinstance(err, errors.ShardingError)
    assert_mentions(err, "'w'", dtype, f"{numel} elements", f"{numel * DTYPE_BITS[dtype]} bits")


@pytest.mark.parametrize("extra", [1, 7, 4096])
def test_trailing_bytes_after_data(tmp_path, extra):
    blob = build({"a": T2}, b"xy" + b"\0" * extra)
    err, _ = reject(tmp_path, blob, FileSizeMismatchError)
    data_end = len(blob) - extra
    assert_mentions(err, f"ends at byte {data_end}", f"file is {len(blob)} bytes", f"{extra} trailing bytes")


@pytest.mark.parametrize("missing", [1, 2])
def test_truncated_data(tmp_path, missing):
    full = build({"a": entry("U8", [2], 0, 2), "b": entry("F32", [1], 2, 6)}, b"x" * 6)
    blob = full[:-missing]
    err, _ = reject(tmp_path, blob, FileSizeMismatchError)
    assert_mentions(err, f"ends at byte {len(full)}", f"file is {len(blob)} bytes", "truncated")


def test_header_only_file_with_tensor_is_truncated(tmp_path):
    blob = build({"a": T2})
    err, _ = reject(tmp_path, blob, FileSizeMismatchError)
    assert_mentions(err, "truncated")


def test_parse_header_uses_the_given_file_size():
    blob = build({"a": T2}, b"xy")
    assert parse_header(blob[:-2], len(blob)).file_size == len(blob)  # header bytes are enough
    with pytest.raises(FileSizeMismatchError):
        parse_header(blob, len(blob) + 1)
    with pytest.raises(HeaderLengthError):
        parse_header(blob, 10)


# --- acceptance --------------------------------------------------------------------


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


# --- agreement with safetensors 0.8, case by case ------------------------------------------


def _reference_accepts(blob: bytes, tmp_path=None) -> bool:
    """safetensors' verdict on `blob` from bytes (deserialize) and, given `tmp_path`, from a file (safe_open)."""
    try:
        safetensors.deserialize(blob)
    except Exception:  # noqa: BLE001  (any refusal is the reference's verdict)
        accepts = False
    else:
        accepts = True
    if tmp_path is not None:
        try:
            with safe_open(write(tmp_path, blob, "reference.safetensors"), framework="pt") as f:
                f.keys()
        except Exception:  # noqa: BLE001
            assert not accepts, "safe_open refuses what deserialize accepts"
        else:
            assert accepts, "safe_open accepts what deserialize refuses"
    return accepts


E2 = '"dtype":"U8","shape":[2],"data_offsets":[0,2]'  # T2's fields, as JSON text


def _unknown_key(value: str, key: str = '"x"') -> tuple[str, bytes]:
    """A valid one-tensor file whose entry also holds an unknown key (JSON text) with `value` (JSON text)."""
    return '{"a":{%s,%s:%s}}' % (E2, key, value), b"xy"


def _zero_elements(dtype: str, shape) -> tuple[str, bytes]:
    return json.dumps({"a": entry(dtype, shape, 0, 0)}), b""


def _nested(depth: int, kind: str) -> tuple[str, bytes]:
    """An unknown key holding containers nested so that the header's deepest is level `depth` (root = 1)."""
    n = depth - 2
    inner = "[" * n + "]" * n if kind == "lists" else '{"k":' * (n - 1) + "{}" + "}" * (n - 1)
    return _unknown_key(inner)


#: case -> (header text, data, None if both accept, else the class raylazy refuses it with (safetensors refuses it too)).
PARITY = {
    # Numbers, which serde_json refuses past the f64 range wherever they are, even in a key it then ignores.
    "unknown-key-1e309": (*_unknown_key("1e309"), HeaderJSONError),
    "unknown-key--1e400": (*_unknown_key("-1e400"), HeaderJSONError),
    "unknown-key-int-400-digits": (*_unknown_key("9" * 400), HeaderJSONError),
    "unknown-key-negative-int-400-digits": (*_unknown_key("-" + "9" * 400), HeaderJSONError),
    "unknown-key-int-308-digits": (*_unknown_key("9" * 308), None),
    "unknown-key-2**64": (*_unknown_key(str(2**64)), None),
    "unknown-key-largest-f64": (*_unknown_key("1.7976931348623157e308"), None),
    # Python rounds it down to the largest f64; serde_json's lossy parser overflows: the reference refuses.
    "unknown-key-largest-f64-plus-an-ulp": (*_unknown_key("1.7976931348623158e308"), HeaderJSONError),
    "unknown-key-1e-400": (*_unknown_key("1e-400"), None),
    "unknown-key-0e99999999999": (*_unknown_key("0e99999999999"), None),
    "unknown-key-1e99999999999": (*_unknown_key("1e99999999999"), HeaderJSONError),
    "unknown-key-nested-1e309": (*_unknown_key('{"k":[0,-1e309]}'), HeaderJSONError),
    "unknown-key--0": (*_unknown_key("-0"), None),
    "metadata-1e309": ('{"__metadata__":{"k":1e309},"a":{%s}}' % E2, b"xy", HeaderJSONError),
    "shape-1e400": ('{"a":{"dtype":"U8","shape":[1e400],"data_offsets":[0,2]}}', b"xy", HeaderJSONError),
    "shape-2E0": ('{"a":{"dtype":"U8","shape":[2E0],"data_offsets":[0,2]}}', b"xy", TensorEntryError),
    # JSON `-0` is a float (-0.0) for serde_json, hence not a usize.
    "negative-zero-dim": ('{"a":{"dtype":"U8","shape":[-0,2],"data_offsets":[0,0]}}', b"", TensorEntryError),
    "negative-zero-offset": ('{"a":{"dtype":"U8","shape":[2],"data_offsets":[-0,2]}}', b"xy", TensorEntryError),
    # Lone UTF-16 surrogate escapes are not Unicode scalar values (Rust strings refuse them); pairs are.
    "lone-surrogate-name": ('{"\\ud800":{%s}}' % E2, b"xy", HeaderEncodingError),
    "lone-surrogate-metadata-value": ('{"__metadata__":{"k":"\\ud800"},"a":{%s}}' % E2, b"xy", HeaderEncodingError),
    "lone-surrogate-metadata-key": ('{"__metadata__":{"\\udc00":"v"},"a":{%s}}' % E2, b"xy", HeaderEncodingError),
    "unknown-key-high-surrogate": (*_unknown_key(r'"\ud800"'), HeaderEncodingError),
    "unknown-key-low-surrogate": (*_unknown_key(r'"\udc00"'), HeaderEncodingError),
    "unknown-key-reversed-pair": (*_unknown_key(r'"\ude00\ud83d"'), HeaderEncodingError),
    "unknown-key-surrogate-in-list": (*_unknown_key(r'[1,"\ud800"]'), HeaderEncodingError),
    "unknown-key-surrogate-in-nested-key": (*_unknown_key(r'{"\ud800":1}'), HeaderEncodingError),
    "unknown-key-named-by-surrogate": (*_unknown_key("1", r'"\udc00"'), HeaderEncodingError),
    "unknown-key-surrogate-pair": (*_unknown_key(r'"\ud83d\ude00"'), None),
    "unknown-key-named-by-pair": (*_unknown_key("1", r'"\ud83d\ude00"'), None),
    "unknown-key-escaped-backslash-u": (*_unknown_key(r'"\\ud800"'), None),
    "unknown-key-escaped-nul": (*_unknown_key(r'"\u0000"'), None),
    # serde_json refuses the 128th level of nesting (the header's object is level 1).
    "nested-lists-127": (*_nested(127, "lists"), None),
    "nested-lists-128": (*_nested(128, "lists"), HeaderJSONError),
    "nested-objects-127": (*_nested(127, "objects"), None),
    "nested-objects-128": (*_nested(128, "objects"), HeaderJSONError),
    "nested-lists-600": (*_nested(600, "lists"), HeaderJSONError),
    # Element counts overflow only if a running product does, so zeros after huge dims are fine.
    "zero-elements-U8-[2**61,0]": (*_zero_elements("U8", [2**61, 0]), None),
    "zero-elements-F64-[2**61,0]": (*_zero_elements("F64", [2**61, 0]), None),
    "zero-elements-U8-[2**64-1,0]": (*_zero_elements("U8", [2**64 - 1, 0]), None),
    "zero-elements-F4-[2**63,0]": (*_zero_elements("F4", [2**63, 0]), None),
    "zero-elements-F64-[0,2**63,2**63]": (*_zero_elements("F64", [0, 2**63, 2**63]), None),
    "overflow-before-zero-dim-[2**63,2,0]": (*_zero_elements("U8", [2**63, 2, 0]), TensorSizeError),
    "overflow-before-zero-dim-[2**63,2**63,0]": (*_zero_elements("U8", [2**63, 2**63, 0]), TensorSizeError),
    # Whitespace, BOM, control characters, escapes.
    "whitespace-tab-cr-lf": ('\t\r\n{"a":{%s}}\t\r\n' % E2, b"xy", None),
    "whitespace-form-feed": ('{"a":{%s}}\x0c' % E2, b"xy", HeaderJSONError),
    "whitespace-nbsp": ('{"a":{%s}}\u00a0' % E2, b"xy", HeaderJSONError),
    "bom": ('\ufeff{"a":{%s}}' % E2, b"xy", HeaderJSONError),
    "raw-control-character-in-string": (*_unknown_key('"a\x01b"'), HeaderJSONError),
    "escaped-field-name": ('{"a":{"\\u0064type":"U8","shape":[2],"data_offsets":[0,2]}}', b"xy", None),
    "escaped-metadata-key": ('{"\\u005f_metadata__":{"k":"v"},"a":{%s}}' % E2, b"xy", None),
    # serde refuses a repeated field of a struct (but not a repeated map key: see STRICTER_THAN_REFERENCE).
    "dtype-twice": ('{"a":{"dtype":"U8",%s}}' % E2, b"xy", DuplicateKeyError),
    "metadata-twice": ('{"__metadata__":{},"__metadata__":{},"a":{%s}}' % E2, b"xy", DuplicateKeyError),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_agrees_with_safetensors(tmp_path, case):
    text, data, exc = PARITY[case]
    blob = build(text, data)
    assert _reference_accepts(blob, tmp_path) == (exc is None)
    if exc is None:
        path = write(tmp_path, blob)
        check_against_reference(path, read_header(path))
    else:
        reject(tmp_path, blob, exc)


#: Deliberate differences: safetensors accepts these, raylazy refuses them (docs/design.md, "Choices made").
STRICTER_THAN_REFERENCE = {
    # safetensors keeps the last value of a repeated key.
    "duplicate-top-level": ('{"a":%s,"a":%s}' % (json.dumps(T2), json.dumps(T2)), DuplicateKeyError),
    "duplicate-metadata-key": ('{"__metadata__":{"k":"v","k":"w"},"a":%s}' % json.dumps(T2), DuplicateKeyError),
    "duplicate-in-unknown-key": (_unknown_key('{"k":1,"k":2}')[0], DuplicateKeyError),
    # serde's other spellings of a struct (a sequence of its fields) and of an enum (a one-key map).
    "entry-as-array": ('{"a":["U8",[2],[0,2]]}', TensorEntryError),
    "dtype-as-map": ('{"a":{"dtype":{"U8":null},"shape":[2],"data_offsets":[0,2]}}', UnknownDTypeError),
}


@pytest.mark.parametrize("case", list(STRICTER_THAN_REFERENCE))
def test_refused_though_safetensors_accepts(tmp_path, case):
    text, exc = STRICTER_THAN_REFERENCE[case]
    blob = build(text, b"xy")
    assert _reference_accepts(blob, tmp_path)
    reject(tmp_path, blob, exc)


# --- properties -----------------------------------------------------------------------

NUMBER = re.compile(rb"-?\d+")
DTYPE_VALUE = re.compile(rb'"dtype": ?"([^"]*)"')


@st.composite
def valid_files(draw):
    """A valid safetensors file (prefix, header, data) built from random tensors."""
    names = draw(st.lists(st.text("abc._0é", min_size=1, max_size=5), max_size=4, unique=True))
    header: dict = {}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text("kv", max_size=2), st.text("xy", max_size=2), max_size=2))
    off = 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        if nbytes_of(dtype, math.prod(shape)) is None:
            shape.append(4)  # 4 x (4 or 6 bits) is whole bytes
        nbytes = nbytes_of(dtype, math.prod(shape))
        header[name] = entry(dtype, shape, off, off + nbytes)
        off += nbytes
    items = draw(st.permutations(list(header.items())))
    compact = draw(st.booleans())
    text = json.dumps(dict(items), separators=(",", ":") if compact else (", ", ": "), ensure_ascii=draw(st.booleans()))
    text += " " * draw(st.integers(0, 7))
    data = draw(st.binary(min_size=off, max_size=off))
    return text.encode("utf-8"), data


INTERESTING = st.sampled_from(list(b'{}[]",:-.0123456789eE \\ntfu\xff\x00\x80'))
NUMBERS = st.one_of(
    st.integers(-3, 40),
    st.integers(0, 40).map(lambda n: n * 8),
    st.integers(2**63 - 2, 2**64 + 2),
    st.sampled_from(["-0", "1.0", "1e3", "NaN", "Infinity", "-Infinity", "1e400", "9" * 30, "null", "true"]),
)


@st.composite
def mutated_files(draw):
    """A valid file with a few random edits to its header, data or length prefix."""
    text, data = draw(valid_files())
    text = bytearray(text)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "number", "number", "dtype", "data", "dup"]))
        if op == "flip" and text:
            i = draw(st.integers(0, len(text) - 1))
            text[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            text.insert(draw(st.integers(0, len(text))), draw(INTERESTING))
        elif op == "delete" and text:
            del text[draw(st.integers(0, len(text) - 1))]
        elif op == "number":
            spans = [m.span() for m in NUMBER.finditer(bytes(text))]
            if spans:
                a, b = draw(st.sampled_from(spans))
                text[a:b] = str(draw(NUMBERS)).encode()
        elif op == "dtype":  # swap a dtype for another, or for a near miss
            spans = [m.span(1) for m in DTYPE_VALUE.finditer(bytes(text))]
            if spans:
                a, b = draw(st.sampled_from(spans))
                text[a:b] = draw(st.sampled_from([*sorted(DTYPE_BITS), "f32", "F8", "Q4", ""])).encode()
        elif op == "data":
            if data and draw(st.booleans()):
                data = data[: draw(st.integers(0, len(data) - 1))]
            else:
                data = data + draw(st.binary(min_size=1, max_size=3))
        elif op == "dup":  # repeat a slice of the header somewhere
            if text:
                a = draw(st.integers(0, len(text) - 1))
                b = draw(st.integers(a, min(len(text), a + 40)))
                text[a:a] = text[a:b]
    if draw(st.integers(0, 9)) == 0:
        prefix = struct.pack("<Q", draw(st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))))
    else:
        prefix = struct.pack("<Q", len(text))
    return prefix + bytes(text) + data


PROPERTY = settings(
    max_examples=300,
    deadline=5000,  # ms per example (parse_header takes microseconds); pytest-timeout bounds the whole test
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,  # the same examples on every run: no flaky CI
    database=None,
)


def _only_raylazy_errors(blob: bytes, file_size: int):
    try:
        return parse_header(blob, file_size)
    except RaylazyError as e:
        assert isinstance(e, HeaderError)
        assert str(e).startswith("<bytes>: ")
        pickle.loads(pickle.dumps(e))  # errors cross Ray process boundaries
        return e


@pytest.mark.timeout(120)
@PROPERTY
@given(st.binary(max_size=300), st.integers(0, 400))
def test_random_bytes_raise_only_raylazy_errors(blob, extra):
    _only_raylazy_errors(blob, len(blob) + extra)


@pytest.mark.timeout(120)
@PROPERTY
@given(st.binary(max_size=120))
def test_random_headers_raise_only_raylazy_errors(text):
    blob = struct.pack("<Q", len(text)) + text
    _only_raylazy_errors(blob, len(blob))


@pytest.mark.timeout(120)
@PROPERTY
@given(valid_files())
def test_valid_files_parse_like_safetensors(file):
    text, data = file
    blob = struct.pack("<Q", len(text)) + text + data
    h = parse_header(blob, len(blob))
    ref = {name: info for name, info in safetensors.deserialize(blob)}
    assert {t.name: (t.dtype, list(t.shape), blob[t.start : t.end]) for t in h.tensors} == {
        name: (info["dtype"], list(info["shape"]), bytes(info["data"])) for name, info in ref.items()
    }


def _known_divergence(ours) -> bool:
    """The deliberate differences of STRICTER_THAN_REFERENCE."""
    return isinstance(ours, DuplicateKeyError) or (
        isinstance(ours, (TensorEntryError, UnknownDTypeError))
        and ("entry is a JSON list" in ours.detail or "unknown dtype {" in ours.detail)
    )


@pytest.mark.timeout(120)
@PROPERTY
@given(mutated_files())
def test_mutated_headers_raise_only_raylazy_errors_and_agree_with_safetensors(blob):
    ours = _only_raylazy_errors(blob, len(blob))
    try:
        ref = {name: info for name, info in safetensors.deserialize(blob)}
    except Exception:  # noqa: BLE001  (any refusal is the reference's verdict)
        ref = None
    if (ref is None) == isinstance(ours, RaylazyError):
        if ref is not None:  # both accept: same tensors
            assert {t.name: (t.dtype, list(t.shape), blob[t.start : t.end]) for t in ours.tensors} == {
                name: (info["dtype"], list(info["shape"]), bytes(info["data"])) for name, info in ref.items()
            }
        return
    assert _known_divergence(ours), (
        f"safetensors {'accepts' if ref is not None else 'refuses'} but raylazy "
        f"{'refuses: ' + repr(ours) if isinstance(ours, RaylazyError) else 'accepts'}: {blob[:400]!r}"
    )


#: The decimal digits of the halfway point between the largest f64 and 2**1024, where rounding overflows.
F64_EDGE = str(int(sys.float_info.max) + 2**970)


@st.composite
def json_numbers(draw):
    """JSON numbers, most within a few ulps of the f64 overflow point (where serde_json's lossy
    parsing, not correct rounding, decides), written with varied digits, decimal points and exponents."""
    if draw(st.integers(0, 4)) == 0:
        number = str(draw(st.one_of(st.integers(-(10**330), 10**330), st.floats(allow_nan=False, allow_infinity=False))))
    else:
        ulps = draw(st.integers(-8, 8))
        digits = str(int(F64_EDGE) + ulps * 2**969)[: draw(st.integers(1, len(F64_EDGE)))]
        digits += draw(st.text("0123456789", max_size=3))
        point = draw(st.integers(1, len(digits)))
        exponent = len(F64_EDGE) - point + draw(st.sampled_from([0, 0, 0, -1, 1]))
        number = digits[:point] + ("." + digits[point:] if point < len(digits) else "")
        if draw(st.booleans()) or point < len(digits):
            number += draw(st.sampled_from("eE")) + draw(st.sampled_from(["", "+"])) + str(exponent)
        else:
            number += "0" * exponent  # an integer of ~309 digits
    return ("-" if draw(st.booleans()) else "") + number.lstrip("-")


@pytest.mark.timeout(120)
@PROPERTY
@given(json_numbers())
def test_numbers_judged_as_safetensors_judges_them(number):
    blob = build(*_unknown_key(number))
    ours = _only_raylazy_errors(blob, len(blob))
    assert _reference_accepts(blob) == isinstance(ours, FileHeader), (number, ours)


# --- pickling --------------------------------------------------------------------


def _all_error_classes():
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, RaylazyError)]


def _instance(cls):
    if issubclass(cls, HeaderError):
        return cls("/models/m/model-00001-of-00002.safetensors", "tensor 'w': shape [3] needs 6 bytes")
    if issubclass(cls, errors.RankFailedError):
        return cls({3: ValueError("boom"), 1: errors.ReadError("short read at byte 12")})
    return cls("/models/m: something about 'w' and 42")


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_errors_pickle_round_trip(cls):
    err = _instance(cls)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    assert back.args == err.args
    assert isinstance(back, RaylazyError)
    if isinstance(err, HeaderError):
        assert (back.path, back.detail) == (err.path, err.detail)
    if isinstance(err, errors.RankFailedError):
        assert list(back.failures) == [1, 3]
        assert {r: (type(e), str(e)) for r, e in back.failures.items()} == {
            r: (type(e), str(e)) for r, e in err.failures.items()
        }


#: What a caller catches, and for what: every error class sits under exactly one of these.
FAMILIES = (
    errors.CheckpointError,  # the files on disk: the directory, the index, config.json, a header
    errors.ShardingError,  # the rules (and tp) against the checkpoint
    errors.PlanFormatError,  # a saved plan that cannot be read back
    errors.ConfigurationError,  # the options of a call
    errors.PlacementError,  # the cluster cannot host the ranks
    errors.LoadError,  # reading on the ranks, after planning and placement
)


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_every_error_sits_in_one_family(cls):
    families = [f for f in FAMILIES if issubclass(cls, f)]
    if cls in (RaylazyError, PartialByteError):  # the root, and the base shared by a header and a sharding kind
        assert families == []
    else:
        assert len(families) == 1, (cls, families)
    if issubclass(cls, HeaderError):
        assert families == [errors.CheckpointError]


def test_every_error_is_on_the_errors_page():
    """docs/errors.md: its table's "catch" column is exactly the families, and the page names every error."""
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "errors.md")).read()
    table = page[: page.index("\n## ")]  # the families' table and what follows it, before the kinds of HeaderError
    caught = {row.split("|")[1].strip() for row in table.splitlines() if row.startswith("| `")}
    assert caught == {f"`{f.__name__}`" for f in FAMILIES}
    for cls in (PartialByteError, errors.RankFailedError):
        assert f"`{cls.__name__}`" in table, cls.__name__
    missing = [c.__name__ for c in _all_error_classes() if f"`{c.__name__}`" not in page]
    assert not missing, f"error classes docs/errors.md does not name: {missing}"


def test_raised_header_errors_pickle_round_trip(tmp_path):
    blob = build({"w": entry("F32", [2], 0, 6)}, b"x" * 6)
    path = write(tmp_path, blob)
    with pytest.raises(TensorSizeError) as info:
        read_header(path)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is TensorSizeError and str(back) == str(info.value) and back.path == path


def test_rank_failed_error_keeps_its_context_across_pickling():
    err = errors.RankFailedError({0: ValueError("boom")}, context="plan")
    assert str(err).startswith("plan failed on 1 rank(s):\n  rank 0: ValueError: boom")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_rank_failed_error_lists_each_cause_once_with_its_ranks():
    """64 ranks failing alike are one line (as Ray Train groups worker errors); causes differing only in numbers
    group too, shown by the lowest rank's message; other causes get lines of their own."""
    same = {r: errors.ReadError(f"/m/a.safetensors: reading tensor 'w' at byte {100 * r}: Input/output error")
            for r in range(64)}
    err = errors.RankFailedError(same)
    assert str(err).splitlines() == [
        "load failed on 64 rank(s):",
        "  ranks 0-63: ReadError: /m/a.safetensors: reading tensor 'w' at byte 0: Input/output error "
        "(the others' differ only in numbers)"]
    mixed = errors.RankFailedError({5: ValueError("boom"), 0: errors.PeerFailedError("peer 3 died"),
                                    1: errors.PeerFailedError("peer 3 died"), 7: ValueError("boom"),
                                    2: errors.PeerFailedError("peer 3 died"), 6: KeyError("x")}, context="reload")
    assert str(mixed).splitlines() == [
        "reload failed on 6 rank(s):",
        "  ranks 0-2: PeerFailedError: peer 3 died",
        "  ranks 5, 7: ValueError: boom",
        "  rank 6: KeyError: 'x'"]
    assert list(mixed.failures) == [0, 1, 2, 5, 6, 7]
