"""raylazy.core.header refuses: every rejection rule of the length prefix, the JSON and the tensor entries, each
with its own RaylazyError naming the file and the fix."""

from __future__ import annotations

import json
import math
import struct

import pytest

from raylazy import errors
from raylazy.core.dtypes import DTYPE_BITS, nbytes_of
from raylazy.core.header import MAX_HEADER_BYTES, parse_header
from raylazy.errors import (
    CheckpointError,
    DataLayoutError,
    DuplicateKeyError,
    FileSizeMismatchError,
    FileTooSmallError,
    HeaderEncodingError,
    HeaderJSONError,
    HeaderLengthError,
    MetadataError,
    PartialByteError,
    PartialByteTensorError,
    TensorEntryError,
    TensorSizeError,
    UnknownDTypeError,
)
from tests.support.headers import T2, assert_mentions, build, entry, reject


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


