"""Strict parser of safetensors headers from bytes (the length prefix and JSON header); reading them is storage's job
(`raylazy.storage.read_header`).

The rules follow huggingface/safetensors (which is the reference for what is
accepted), including its JSON parser's (serde_json's) limits everywhere in the
header: numbers it finds out of the f64 range, lone UTF-16 surrogate escapes in
strings and keys, containers nested deeper than 127 levels. They are stricter
where the format leaves room for ambiguity: duplicate keys at any level, and
tensor entries (or dtypes) spelled in serde's alternative forms (a JSON array
for the entry, `{"F32": null}` for the dtype), are refused. Each failure kind
has its own exception class.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, chain, repeat
from math import prod
from operator import add, attrgetter, itemgetter, sub
from types import MappingProxyType
from typing import Any, NamedTuple

from ..errors import (
    DataLayoutError,
    DuplicateKeyError,
    FileSizeMismatchError,
    FileTooSmallError,
    HeaderEncodingError,
    HeaderError,
    HeaderJSONError,
    HeaderLengthError,
    MetadataError,
    PartialByteTensorError,
    TensorEntryError,
    TensorSizeError,
    TooManyEntriesError,
    UnknownDTypeError,
)
from .dtypes import DTYPE_BITS, nbytes_of

#: Largest header the reader accepts, as in huggingface/safetensors.
MAX_HEADER_BYTES = 100_000_000
#: Most ',' separators (JSON items) a header may hold, counted before parsing. Python's JSON parser
#: takes time and memory in proportion to the items, and a header within MAX_HEADER_BYTES can hold over a million
#: tiny tensors; this cap bounds both, far above what a real header needs. Each tensor entry needs at least 4, so
#: a file holds at most 2**18 tensors (save_pretrained shards hold a few thousand), or that many metadata entries
#: or shape dims.
#: The '[' and '{' (containers) are capped at the same number (each tensor entry needs 3).
MAX_HEADER_ITEMS = 2**20
#: Deepest nesting of JSON arrays and objects (the header's own object is level 1) that the reference
#: accepts: serde_json refuses the 128th level.
MAX_HEADER_DEPTH = 127
_U64 = 2**64
_I32_MAX = 2**31 - 1
_NUMBER = re.compile(r"-?(\d+)(?:\.(\d+))?(?:[eE]([+-]?)(\d+))?")
_ENTRY_FIELDS = ("dtype", "shape", "data_offsets")
#: Every digit as "0", to find runs of 20 digits with one substring search (`_special_ints`).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")


class TensorInfo(NamedTuple):
    """One tensor of a file: its dtype, shape and absolute byte range [start, end). A named tuple: a large
    checkpoint's headers hold ~10^5 of them, and it is built 2-3x faster than a frozen dataclass."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FileHeader:
    """The parsed header of one safetensors file; tensors are in file-offset order."""

    path: str
    file_size: int
    header_len: int
    tensors: tuple[TensorInfo, ...]
    metadata: Mapping[str, str] | None
    #: sha256 of the 8-byte prefix and the header: identifies the file's layout later.
    digest: str
    #: The storage's version tag of the file read (an object's ETag; "" for local files).
    version: str = ""

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def parse_header(data: bytes, file_size: int, path: str = "<bytes>") -> FileHeader:
    """Validate `data` (the first 8 + N bytes of a file of `file_size` bytes)."""
    if len(data) < 8:
        raise FileTooSmallError(path, f"file is {len(data)} bytes, shorter than the 8-byte header length prefix")
    header_len = check_length(path, data[:8], file_size)
    blob = bytes(data[8 : 8 + header_len])
    _check_item_counts(path, blob)
    try:
        text = blob.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise HeaderEncodingError(path, f"header is not valid UTF-8 at byte {e.start} of {header_len}") from None
    common = _common_header(path, blob, text, 8 + header_len)
    if common is None:  # read (again), every key and entry checked in order: the reference's first error
        root, tensors, metadata = _parse_json(path, text, _special_ints(blob)), [], None
        for name, entry in root.items():
            _check_text(path, name)
            if name == "__metadata__":
                metadata = _check_metadata(path, entry)
            else:
                tensors.append(_check_entry(path, name, entry, 8 + header_len))
    else:
        tensors, metadata = common
    if not _fills(tensors, 8 + header_len, file_size):  # not in offset order (or not laid out right)
        tensors.sort(key=_BY_RANGE)
        _check_layout(path, tensors, 8 + header_len, file_size)
    return FileHeader(
        path=path,
        file_size=file_size,
        header_len=header_len,
        tensors=tuple(tensors),
        metadata=metadata,
        digest=hashlib.sha256(data[: 8 + header_len]).hexdigest(),
    )


def _common_header(path: str, blob: bytes, text: str, data_start: int) -> tuple[list[TensorInfo], Any] | None:
    """(tensors, metadata) of a header of the common form, read at C speed: as safetensors writes it
    (`_written_header`), else no `\\u` escape (so every string is its bytes, and no lone surrogate can hide in one),
    JSON Python reads as the reference does, every entry the common one (`_common_entries`), no key repeated
    (`_distinct_keys`). None for any other header, which `parse_header` then reads key by key."""
    written = _written_header(blob, text, data_start)
    if written is not None:
        return written
    if b"\\u" in blob:
        return None
    try:
        root = _parse_json(path, text, _special_ints(blob), repeats=False)
    except HeaderError:
        return None
    tensors = _common_entries(root, data_start)
    if tensors is None or not _distinct_keys(blob, root, len(tensors)):
        return None
    return tensors, _check_metadata(path, root.get("__metadata__"))


#: The bytes a JSON string may not hold raw (the reference refuses them, as Python's parser does).
_CONTROL = bytes(range(32))
#: A header's metadata as safetensors writes it, first: strings without escapes, and the comma after it.
_WRITTEN_METADATA = re.compile(r'"__metadata__":\{((?:"[^"]*":"[^"]*"(?:,"[^"]*":"[^"]*")*)?)\},')
_METADATA_PAIR = re.compile(r'"([^"]*)":"([^"]*)"')
#: A tensor entry as safetensors writes it (compact, its fields in this order; dims past 0 and offsets as JSON
#: spells integers under 20 digits), and the comma after it: its name, dtype, dims, begin and end.
_WRITTEN_ENTRY = re.compile(
    r'"([^"]*)":\{"dtype":"([A-Z0-9_]+)","shape":\[((?:[1-9][0-9]{0,18}(?:,[1-9][0-9]{0,18})*)?)\],'
    r'"data_offsets":\[(0|[1-9][0-9]{0,18}),(0|[1-9][0-9]{0,18})\]\},')


def _written_header(blob: bytes, text: str, data_start: int) -> tuple[list[TensorInfo], Any] | None:
    """(tensors, metadata) of a header exactly as safetensors writes one: `{`, the metadata first if any, then
    compact entries (`_WRITTEN_ENTRY`), `}`, then spaces to pad it; no backslash and no control character in it,
    so every string is its characters. Read by one regular expression, without building the JSON's dicts and
    lists: the header split at its entries, into their fields and the text between them, all of it empty.
    Its offsets are checked as written, all at once: from 0, each tensor's where the last ended, its end its
    shape's whole bytes (no empty dim) past its begin. None for any other header, or one whose entries are not
    so laid out or not common (`_common_entries`), or whose names or metadata keys repeat: the JSON reading then
    decides."""
    if b"\\" in blob or len(blob.translate(None, _CONTROL)) != len(blob):
        return None
    body = text.rstrip(" ")
    if body[:1] != "{" or body[-1:] != "}":
        return None
    metadata, at = None, 1
    m = _WRITTEN_METADATA.match(body, 1)
    if m is not None:
        pairs = _METADATA_PAIR.findall(m.group(1))
        metadata, at = dict(pairs), m.end()
        if len(metadata) != len(pairs):
            return None
    pieces = _WRITTEN_ENTRY.split(body[at:-1] + ",")  # what lies before each entry, its 5 fields, ..., the end
    if len(pieces) == 1 or any(pieces[::6]):  # no entry, or text between entries (or after the last)
        return None
    names, dtypes, shapes, begins, ends = (pieces[i::6] for i in range(1, 6))
    if len(set(names)) != len(names) or "__metadata__" in names or not set(dtypes) <= _BITS.keys() \
            or begins[0] != "0" or begins[1:] != ends[:-1]:  # not one after another from byte 0, as written
        return None
    dims = {s: tuple(map(int, s.split(","))) if s else () for s in set(shapes)}
    shapes = list(map(dims.__getitem__, shapes))
    sizes = _sizes(shapes, dtypes)
    if sizes is None or list(map(int, ends)) != list(accumulate(sizes)):  # each tensor's bytes fill its offsets
        return None
    bounds = list(accumulate(sizes, initial=data_start))
    tensors = list(map(_new_info, zip(names, dtypes, shapes, bounds, bounds[1:])))
    return tensors, None if metadata is None else MappingProxyType(metadata)


def _distinct_keys(blob: bytes, root: dict, entries: int) -> bool:
    """Whether no key of the header `blob` was repeated, `root` being its JSON read without the check, of the
    common form: `entries` entries of three keys, whose strings (known dtypes) hold no ':', and the metadata.
    Without escapes, a ':' byte is either a key's colon or inside a string: the colons of the bytes are the
    colons of the keys and strings read only if no key was dropped as a repetition."""
    meta = root.get("__metadata__")
    strings = list(root)
    if isinstance(meta, dict) and set(map(type, meta.values())) <= {str}:
        strings += [*meta, *meta.values()]
    elif meta is not None:
        return False
    keys = len(root) + 3 * entries + (len(meta) if meta else 0)
    return blob.count(b":") == keys + sum(map(str.count, strings, [":"] * len(strings)))


_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_START, _END, _BY_RANGE = attrgetter("start"), attrgetter("end"), attrgetter("start", "end")
_BITS = dict(DTYPE_BITS)


def _common_entries(root: dict, data_start: int) -> list[TensorInfo] | None:
    """The tensors of a header whose every entry is the common one, checked field by field over all entries at
    once: exactly dtype, shape and data_offsets, a known dtype, dims and offsets integers in [0, 2**64) with no
    empty dim, whole bytes that fill the offsets (`_infos`). None when any entry is not (`_check_entry` then
    finds it)."""
    entries = {k: v for k, v in root.items() if k != "__metadata__"}
    values = list(entries.values())
    if not values:
        return []
    try:
        if set(map(type, values)) != {dict} or set(map(len, values)) != {3}:
            return None
        dtypes, shapes, offsets = list(map(_DTYPE, values)), list(map(_SHAPE, values)), list(map(_OFFSETS, values))
        if not set(dtypes) <= _BITS.keys() or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
            return None
    except (KeyError, TypeError):  # a field missing, or one that is unhashable where a dtype should be
        return None
    shapes = list(map(tuple, shapes))
    if not set(map(type, chain.from_iterable(shapes))) <= {int} or set(map(len, offsets)) != {2}:
        return None
    return _infos(entries, dtypes, shapes, list(map(itemgetter(0), offsets)), list(map(itemgetter(1), offsets)),
                  data_start)


def _infos(names, dtypes: list[str], shapes: list[tuple[int, ...]], begins: list, ends: list,
           data_start: int) -> list[TensorInfo] | None:
    """The TensorInfos of entries given field by field (known dtypes, dims integers), if their offsets are integers
    in [0, 2**64) and each shape of its dtype is whole bytes (no empty dim) that fill its offsets; else None."""
    sizes = _sizes(shapes, dtypes)
    if sizes is None or not _u64s(begins, 0) or not _u64s(ends, 0) or sizes != list(map(sub, ends, begins)):
        return None
    at = repeat(data_start)
    return list(map(_new_info, zip(names, dtypes, shapes, map(add, begins, at), map(add, ends, at))))


def _sizes(shapes: list[tuple[int, ...]], dtypes: list[str]) -> list[int] | None:
    """Each tensor's bytes (`_whole_bytes`), or None if any shape of its dtype is not whole bytes under 2**64 (or
    has an empty dim). Worked out once per distinct (shape, dtype): a file's hundreds of tensors have a few dozen."""
    kinds = list(zip(shapes, dtypes))
    nbytes = {kind: _whole_bytes(*kind) for kind in set(kinds)}
    return None if None in nbytes.values() else list(map(nbytes.__getitem__, kinds))


#: A TensorInfo from its fields' tuple, made in C (`map` calls it once per tensor).
_new_info = partial(tuple.__new__, TensorInfo)


def _whole_bytes(shape: tuple[int, ...], dtype: str) -> int | None:
    """The bytes of a tensor of `shape` (no dim 0 or past 2**64) and `dtype`, whole and under 2**64; else None."""
    if not all(0 < d < _U64 for d in shape):
        return None
    bits = prod(shape) * _BITS[dtype]
    return bits // 8 if bits < _U64 and not bits % 8 else None


def _u64s(values: list, low: int) -> bool:
    """Whether `values` are all integers (not bools) in [low, 2**64)."""
    return set(map(type, values)) == {int} and min(values) >= low and max(values) < _U64


def _check_item_counts(path: str, blob: bytes) -> None:
    """Refuse, before parsing, a header with more separators or more containers than MAX_HEADER_ITEMS.

    Separators bound the values side by side; containers bound the values nested in one another
    (100 MB of `[[[...]]]` 120 deep has few commas but ~50 M lists: ~50 s and 4.6 GB to parse).
    """
    for what, n in (
        ("JSON items (',' separators)", blob.count(b",")),
        ("JSON containers ('[' and '{')", blob.count(b"[") + blob.count(b"{")),
    ):
        if n > MAX_HEADER_ITEMS:
            raise TooManyEntriesError(
                path, f"header holds {n} {what}, over the cap of {MAX_HEADER_ITEMS} (at most "
                f"{MAX_HEADER_ITEMS // 4} tensors per file); refused before parsing to bound time and memory"
            )


def _special_ints(blob: bytes) -> bool:
    """Whether header bytes `blob` may hold an integer the reference reads its own way: a `-0`, or 20 digits in a
    row (a superset: the same bytes in strings and floats count too, and then every integer is read its way)."""
    return b"-0" in blob or b"0" * 20 in blob.translate(_DIGITS_AS_ZERO)


def check_length(path: str, prefix: bytes, file_size: int) -> int:
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise HeaderLengthError(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise HeaderLengthError(path, f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def _no_duplicates(path: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):  # a key repeats: name the first repetition
            seen = set()
            for k, _ in pairs:
                if k in seen:
                    raise DuplicateKeyError(path, f"header repeats the key {k!r}")
                seen.add(k)
        return out

    return hook


def _parse_json(path: str, text: str, special: bool = True, repeats: bool = True) -> dict:
    """The header's JSON object, read as the reference reads it. `special`: the text may hold integers that the
    reference reads its own way (`-0`, integers of 20 digits or more; `_special_ints` says); if not, Python's
    own integer parsing stands, and no hook runs per integer. `repeats`: refuse a repeated key (False: the last
    one stands, for `_common_header`, which counts the keys itself)."""
    def no_constant(name: str):
        raise HeaderJSONError(path, f"header uses the non-standard JSON constant {name}")

    def number(s: str, convert):
        if abs(float(s)) >= 1.797e308 and _out_of_f64_range(s):  # only near or past the largest f64
            raise HeaderJSONError(path, f"header number {s[:40]}{'...' if len(s) > 40 else ''} is out of "
                                  "the range of a 64-bit float, which the reference reader refuses")
        return convert(s)

    try:
        root = json.loads(
            text,
            object_pairs_hook=_no_duplicates(path) if repeats else None,
            parse_constant=no_constant,
            parse_float=lambda s: number(s, float),
            # `-0` is a float to the reference reader; integers past 19 digits are floats there too
            parse_int=(lambda s: -0.0 if s == "-0" else int(s) if len(s) < 20 else number(s, int)) if special else None,
        )
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, deep nesting
        raise HeaderJSONError(path, f"header is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(root, dict):
        raise HeaderJSONError(path, f"header is a JSON {type(root).__name__}, not an object")
    return root


def _out_of_f64_range(number: str) -> bool:
    """Whether the reference's JSON parser refuses the JSON number `number` as out of range.

    serde_json (built without `float_roundtrip`, as safetensors is) keeps the leading digits
    that fit a u64, drops the rest (counting dropped integer digits in the exponent), and scales
    by a power of ten in f64, refusing an infinite result: a few numbers within an ulp of the
    largest f64 (1.7976931348623158e308) are refused there, though they round to it.
    """
    whole, frac, sign, exp = _NUMBER.fullmatch(number).groups()
    significand, exponent = 0, 0
    for i, c in enumerate(whole):
        if significand * 10 + int(c) >= _U64:
            exponent = len(whole) - i
            break
        significand = significand * 10 + int(c)
    if frac and not significand:  # leading zeros only move the exponent (and may be megabytes long)
        exponent -= len(frac) - len(frac.lstrip("0"))
        frac = frac.lstrip("0")
    for c in frac or "":
        if significand * 10 + int(c) >= _U64:
            break
        significand, exponent = significand * 10 + int(c), exponent - 1
    if exp is not None:
        digits = exp.lstrip("0") or "0"
        e = int(digits) if len(digits) <= 10 else _I32_MAX + 1
        if e > _I32_MAX:  # serde_json gives up: 0 if the significand is 0 or the exponent negative, else refused
            return significand != 0 and sign != "-"
        exponent += -e if sign == "-" else e
    if significand == 0 or exponent < 0:
        return False
    return exponent > 308 or math.isinf(float(significand) * float(f"1e{exponent}"))


def _check_free_json(path: str, where: str, value: Any, depth: int) -> None:
    """An unknown key's value, which the reference parses and drops: its strings must be Unicode text
    and its containers (at `depth`, the header's own object being 1) no deeper than MAX_HEADER_DEPTH."""
    if isinstance(value, str):
        _check_text(path, value)
    elif isinstance(value, (list, dict)):
        if depth > MAX_HEADER_DEPTH:
            raise HeaderJSONError(path, f"{where}: header nests JSON containers deeper than {MAX_HEADER_DEPTH} "
                                  "levels, which the reference reader refuses")
        if isinstance(value, dict):
            for key in value:
                _check_text(path, key)
            value = value.values()
        for item in value:
            _check_free_json(path, where, item, depth + 1)


def _check_metadata(path: str, entry: Any) -> Mapping[str, str] | None:
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise MetadataError(path, f"__metadata__ is a JSON {type(entry).__name__}, not a map of strings to strings")
    for k, v in entry.items():
        if not isinstance(v, str):
            raise MetadataError(path, f"__metadata__[{k!r}] is a JSON {type(v).__name__}, not a string")
        _check_text(path, k)
        _check_text(path, v)
    return MappingProxyType(entry)


def _check_text(path: str, text: str) -> None:
    """JSON escapes can spell lone UTF-16 surrogates, which are not Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise HeaderEncodingError(path, f"header string {text!r} holds a lone surrogate escape") from None


def _is_u64(x: Any) -> bool:
    return type(x) is int and 0 <= x < _U64


def _check_entry(path: str, name: str, entry: Any, data_start: int) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise TensorEntryError(path, f"{where}: entry is a JSON {type(entry).__name__}, not an object")
    missing = [k for k in _ENTRY_FIELDS if k not in entry]
    if missing:
        raise TensorEntryError(path, f"{where}: entry lacks {', '.join(missing)}")
    for key, value in entry.items():
        if key not in _ENTRY_FIELDS:  # ignored, as the reference ignores it, once it parses as the reference parses
            _check_text(path, key)
            _check_free_json(path, f"{where}, key {key!r}", value, 3)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise UnknownDTypeError(path, f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise TensorEntryError(path, f"{where}: shape {shape!r} is not a list of integers in [0, 2**64)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        raise TensorEntryError(path, f"{where}: data_offsets {offsets!r} is not two integers in [0, 2**64)")
    begin, end = offsets
    if end < begin:
        raise DataLayoutError(path, f"{where}: data_offsets [{begin}, {end}] end before they begin")
    numel = 1
    for d in shape:  # left to right, failing on the first overflow even before a 0 dim, as the reference does
        numel *= d
        if numel >= _U64:
            break
    if numel * DTYPE_BITS[dtype] >= _U64:  # then its bit count must fit too
        raise TensorSizeError(path, f"{where}: shape {shape} of {dtype} overflows 64 bits (element or bit count)")
    nbytes = nbytes_of(dtype, numel)
    if nbytes is None:
        raise PartialByteTensorError(
            path, f"{where}: {numel} elements of {dtype} are {numel * DTYPE_BITS[dtype]} bits, not whole bytes"
        )
    if nbytes != end - begin:
        raise TensorSizeError(
            path, f"{where}: shape {shape} of {dtype} needs {nbytes} bytes but data_offsets [{begin}, {end}] hold {end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _fills(tensors: list[TensorInfo], data_start: int, file_size: int) -> bool:
    """Whether `tensors`, in their order, fill the data section [`data_start`, `file_size`) one after another
    (then they are in offset order already, as safetensors writes them)."""
    ends = [data_start, *map(_END, tensors)]
    return ends[-1] == file_size and ends[:-1] == list(map(_START, tensors))


def _check_layout(path: str, tensors: list[TensorInfo], data_start: int, file_size: int) -> None:
    """DataLayoutError or FileSizeMismatchError unless `tensors` (in offset order) fill the data section
    [`data_start`, `file_size`) one after another, naming the first that does not (`parse_header` asks `_fills`,
    all at once, first)."""
    expected = data_start
    for t in tensors:
        if t.start != expected:
            kind = "a hole before" if t.start > expected else "an overlap at"
            raise DataLayoutError(
                path,
                f"tensor {t.name!r}: data starts at byte {t.start - data_start} of the data section, "
                f"expected {expected - data_start} ({kind} it)",
            )
        expected = t.end
    if expected != file_size:
        how = "truncated" if expected > file_size else f"followed by {file_size - expected} trailing bytes"
        raise FileSizeMismatchError(
            path, f"tensor data ends at byte {expected} but the file is {file_size} bytes ({how})"
        )
