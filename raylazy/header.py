"""Strict reader of safetensors headers: reads the length prefix and JSON header, never tensor data.

The rules follow huggingface/safetensors (which is the reference for what is
accepted) and are stricter where the format leaves room for ambiguity: duplicate
keys at any level, floats or booleans where integers belong, and integers at or
past 2**64 are refused. Each failure kind has its own exception class.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from .dtypes import DTYPE_BITS, nbytes_of
from .errors import (
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
    TensorEntryError,
    TensorSizeError,
    TooManyEntriesError,
    UnknownDTypeError,
)
from .storage import NotAFileError, open_source

#: Largest header the reader accepts, as in huggingface/safetensors.
MAX_HEADER_BYTES = 100_000_000
#: Most ',' separators (JSON items) a header may hold, counted before parsing. Python's JSON parser
#: needs ~47 s and 1.5 GB for a 100 MB header of 1.65 M tiny tensors (2 cores); this cap bounds that to a few
#: seconds and a few hundred MB. Each tensor entry needs at least 4, so a file holds at most 2**18
#: tensors (save_pretrained shards hold a few thousand), or that many metadata entries or shape dims.
MAX_HEADER_ITEMS = 2**20
_U64 = 2**64


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a file: its dtype, shape and absolute byte range [start, end)."""

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

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


def read_header(path: str | os.PathLike) -> FileHeader:
    """Read and validate the header of the safetensors file at `path` (a path or URI; no tensor data)."""
    path = os.fspath(path)
    try:
        source = open_source(path)
    except NotAFileError:
        raise HeaderError(path, "not a regular file (a directory, FIFO or device), so not a safetensors file") from None
    with source:
        file_size = source.size
        source.random_access()  # read the header and nothing past it (see LocalSource.random_access)
        prefix = source.read(0, min(8, file_size))
        if len(prefix) < 8:
            raise FileTooSmallError(path, f"file is {file_size} bytes, shorter than the 8-byte header length prefix")
        header_len = _check_length(path, prefix, file_size)
        blob = source.read(8, header_len)
    return parse_header(prefix + blob, file_size, path)


def parse_header(data: bytes, file_size: int, path: str = "<bytes>") -> FileHeader:
    """Validate `data` (the first 8 + N bytes of a file of `file_size` bytes)."""
    if len(data) < 8:
        raise FileTooSmallError(path, f"file is {len(data)} bytes, shorter than the 8-byte header length prefix")
    header_len = _check_length(path, data[:8], file_size)
    blob = bytes(data[8 : 8 + header_len])
    items = blob.count(b",")
    if items > MAX_HEADER_ITEMS:
        raise TooManyEntriesError(
            path, f"header holds {items} JSON items (',' separators), over the cap of {MAX_HEADER_ITEMS} "
            f"(at most {MAX_HEADER_ITEMS // 4} tensors per file); refused before parsing to bound time and memory"
        )
    try:
        text = blob.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise HeaderEncodingError(path, f"header is not valid UTF-8 at byte {e.start} of {header_len}") from None
    root = _parse_json(path, text)
    metadata = None
    tensors = []
    for name, entry in root.items():
        _check_text(path, name)
        if name == "__metadata__":
            metadata = _check_metadata(path, entry)
        else:
            tensors.append(_check_entry(path, name, entry, 8 + header_len))
    tensors.sort(key=lambda t: (t.start, t.end))
    _check_layout(path, tensors, 8 + header_len, file_size)
    return FileHeader(
        path=path,
        file_size=file_size,
        header_len=header_len,
        tensors=tuple(tensors),
        metadata=metadata,
        digest=hashlib.sha256(data[: 8 + header_len]).hexdigest(),
    )


def _check_length(path: str, prefix: bytes, file_size: int) -> int:
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise HeaderLengthError(path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > file_size:
        raise HeaderLengthError(path, f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def _no_duplicates(path: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                raise DuplicateKeyError(path, f"header repeats the key {k!r}")
            out[k] = v
        return out

    return hook


def _parse_json(path: str, text: str) -> dict:
    def no_constant(name: str):
        raise HeaderJSONError(path, f"header uses the non-standard JSON constant {name}")

    try:
        root = json.loads(
            text,
            object_pairs_hook=_no_duplicates(path),
            parse_constant=no_constant,
            parse_int=lambda s: -0.0 if s == "-0" else int(s),  # `-0` is a float to the reference reader
        )
    except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, deep nesting
        raise HeaderJSONError(path, f"header is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(root, dict):
        raise HeaderJSONError(path, f"header is a JSON {type(root).__name__}, not an object")
    return root


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
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise TensorEntryError(path, f"{where}: entry lacks {', '.join(missing)}")
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
    for d in shape:  # left to right with overflow checks, as the reference reader multiplies
        numel *= d
        if numel * DTYPE_BITS[dtype] >= _U64:
            raise TensorSizeError(path, f"{where}: shape {shape} of {dtype} overflows 64 bits")
    nbytes = nbytes_of(dtype, numel)
    if nbytes is None:
        raise PartialByteError(
            path, f"{where}: {numel} elements of {dtype} are {numel * DTYPE_BITS[dtype]} bits, not whole bytes"
        )
    if nbytes != end - begin:
        raise TensorSizeError(
            path, f"{where}: shape {shape} of {dtype} needs {nbytes} bytes but data_offsets [{begin}, {end}] hold {end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_layout(path: str, tensors: list[TensorInfo], data_start: int, file_size: int) -> None:
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
