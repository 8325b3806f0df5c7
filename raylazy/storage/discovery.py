"""Find a checkpoint through storage: its safetensors files (an index, one file, or a directory's files), their
headers, and config.json, read and handed to the core's parsers (`raylazy.core.header`, `raylazy.core.checkpoint`).

Symbolic links are followed (the Hugging Face cache links each shard to a blob elsewhere), but only names the
directory itself lists (or its index names) are ever opened, and whatever they point to must parse as a valid
safetensors file.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from ..core.checkpoint import (
    INDEX_NAME,
    MAX_JSON_BYTES,
    SINGLE_NAME,
    Checkpoint,
    ModelConfig,
    cross_check,
    parse_config,
    parse_index,
)
from ..core.header import FileHeader, check_length, parse_header
from ..errors import (
    CheckpointNotFoundError,
    FileTooSmallError,
    HeaderError,
    IndexFileError,
    MissingShardError,
    ModelConfigError,
)
from .base import Listing, NotAFileError, Source, Storage
from .hub import resolve_model
from .registry import open_source, storage_for
from .verified import requested
from .watch import watched

#: Files whose headers `open_checkpoint` reads at once.
_HEADER_READERS = 16


def read_header(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> FileHeader:
    """Read and validate the header of the safetensors file at `path` (a path or URI, opened with
    `storage_options`; no tensor data)."""
    path = os.fspath(path)
    try:
        source = open_source(path, storage_options)
    except NotAFileError:
        raise HeaderError(path, "not a regular file (a directory, FIFO or device), so not a safetensors file") from None
    return _header(source, path)


def _header(source: Source, path: str) -> FileHeader:
    """The validated header of the opened file `source` (closed after)."""
    with source:
        file_size = source.size
        source.random_access()  # read the header and nothing past it (see LocalSource.random_access)
        prefix = source.read(0, min(8, file_size))
        if len(prefix) < 8:
            raise FileTooSmallError(path, f"file is {file_size} bytes, shorter than the 8-byte header length prefix")
        blob = source.read(8, check_length(path, prefix, file_size))
    return replace(parse_header(prefix + blob, file_size, path), version=source.version)


def open_checkpoint(model_dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                    request_timeout_s: float | None = None) -> Checkpoint:
    """Discover the safetensors files of `model_dir` (a path or URI, or a model id in the local Hugging Face
    cache), validate their headers and read config.json; object storage is reached with `storage_options`. With
    `request_timeout_s`, a request (a listing, opening a file, reading a header) unanswered that long raises
    StorageStallError (the discovery runs as a watched read: `raylazy.storage.watch`).

    Requests to object storage: one LIST of the directory, then one GET per file it names (index, shards,
    config.json; two for a header longer than `raylazy.storage.objects.HEAD_BYTES`), nothing looked up twice."""
    if request_timeout_s is not None:
        return watched(lambda: open_checkpoint(model_dir, storage_options), request_timeout_s)
    model = resolve_model(model_dir)
    storage = storage_for(model, storage_options)
    path = storage.absolute(model)
    with requested(path, "listing the checkpoint"):
        listing = storage.listing(path)
    if listing is None:  # a file, or nothing: opening it says which
        root, name = storage.split(path)
        with requested(root, "listing the checkpoint's directory"):
            names, weight_map, listing = [name], None, storage.listing(root)
    else:
        root = path
        names, weight_map = _discover(storage, root, listing)
    index = storage.join(root, INDEX_NAME)
    headers = _read_shards(storage, [storage.join(root, n) for n in names])
    cross_check(root, index, names, headers, weight_map)
    return Checkpoint(root=root, files=headers, config=_read_config(storage, root, listing))


def _discover(storage: Storage, root: str, listing: Listing) -> tuple[list[str], dict[str, str] | None]:
    index = storage.join(root, INDEX_NAME)
    if INDEX_NAME in listing.names:
        weight_map = parse_index(_read_small(storage, index, IndexFileError), index)
        names = sorted(set(weight_map.values()))
        if not names:
            raise CheckpointNotFoundError(f"{index}: 'weight_map' names no tensors")
        missing = [n for n in names if n not in listing.files]  # absent, or not a plain file
        if missing:
            raise MissingShardError(f"{index}: shard {missing[0]!r} is not in {root}")
        return names, weight_map
    if SINGLE_NAME in listing.files:
        return [SINGLE_NAME], None
    names = sorted(n for n in listing.files if n.endswith(".safetensors"))
    if not names:
        raise CheckpointNotFoundError(
            f"{root}: no {INDEX_NAME}, no {SINGLE_NAME} and no *.safetensors files; point raylazy at a model directory"
        )
    return names, None


def _read_shards(storage: Storage, paths: list[str]) -> tuple[FileHeader, ...]:
    """Each file's header, read at once (`_HEADER_READERS` at a time): on network or object storage each read waits
    for the storage, so N files cost its latency about once, not N times. Each read runs in the caller's context (a
    watched load's requests stay its own); the first failing file, in order, raises."""
    if len(paths) < 2:
        return tuple(_read_shard(storage, p) for p in paths)
    with ThreadPoolExecutor(min(len(paths), _HEADER_READERS), thread_name_prefix="raylazy-headers") as pool:
        reads = [pool.submit(contextvars.copy_context().run, _read_shard, storage, p) for p in paths]
        return tuple(r.result() for r in reads)


def _read_shard(storage: Storage, path: str) -> FileHeader:
    with requested(path, "opening it and reading its header"):
        try:
            source = storage.open(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such file or directory") from None
        except NotAFileError:
            raise CheckpointNotFoundError(f"{path}: not a regular file or directory (a FIFO or device)") from None
        return _header(source, path)


def _read_config(storage: Storage, root: str, listing: Listing | None) -> ModelConfig:
    """config.json where `root` (whose `listing` it is) holds one, else the empty config."""
    if listing is None or "config.json" not in listing.names:
        return ModelConfig()
    path = storage.join(root, "config.json")
    return parse_config(_read_small(storage, path, ModelConfigError), path)


def _read_small(storage: Storage, path: str, error: type) -> bytes:
    """The bytes of a plain file of at most MAX_JSON_BYTES; a FIFO, device or directory (an index
    linked to /dev/zero would never end) or a larger file raises `error`."""
    with requested(path, "reading it"):
        try:
            source = storage.open(path)
        except NotAFileError:
            raise error(f"{path}: not a regular file (a directory, FIFO or device)") from None
        except OSError as e:
            raise error(f"{path}: cannot open: {e.strerror}") from None
        with source:
            if source.size > MAX_JSON_BYTES:
                raise error(f"{path}: larger than the {MAX_JSON_BYTES}-byte cap for JSON files")
            try:
                return source.read(0, source.size)
            except OSError as e:
                raise error(f"{path}: cannot read: {e.strerror}") from None
