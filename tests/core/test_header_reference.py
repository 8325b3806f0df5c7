"""raylazy.core.header against safetensors 0.8 itself: case by case, and by property (hypothesis), only
RaylazyError escapes and raylazy accepts what safetensors accepts, bar the documented stricter rules."""

from __future__ import annotations

import json
import math
import pickle
import re
import struct
import sys

import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from raylazy.core.dtypes import DTYPE_BITS, nbytes_of
from raylazy.core.header import FileHeader, parse_header
from raylazy.errors import (
    DuplicateKeyError,
    HeaderEncodingError,
    HeaderError,
    HeaderJSONError,
    RaylazyError,
    TensorEntryError,
    TensorSizeError,
    UnknownDTypeError,
)
from raylazy.storage import read_header
from tests.support.headers import T2, build, check_against_reference, entry, reject, write


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


