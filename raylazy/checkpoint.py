"""Find a checkpoint's safetensors files, read their headers and the model's config.json.

A model directory is one of: a single `model.safetensors`; a
`model.safetensors.index.json` and the shards its `weight_map` names (as
transformers' `save_pretrained` writes them); or a set of `*.safetensors` files.
A path to one `.safetensors` file is accepted too.

Shards must be plain file names inside the directory. Symbolic links are followed
(the Hugging Face cache links each shard to a blob elsewhere), but only names the
directory itself lists are ever opened, and whatever they point to must parse as a
valid safetensors file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping

from .errors import (
    CheckpointNotFoundError,
    DuplicateTensorError,
    HeaderError,
    IndexFileError,
    MissingShardError,
    MissingTensorError,
    ModelConfigError,
    UnsafePathError,
)
from .header import FileHeader, TensorInfo, read_header
from .hub import resolve_model
from .storage import NotAFileError, Storage, storage_for

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Largest index or config.json read (bytes); real indexes are a few MB at most.
MAX_JSON_BYTES = 100_000_000


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a transformers `config.json` that decide how tensors are sharded."""

    model_type: str | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    num_hidden_layers: int | None = None
    intermediate_size: int | None = None
    num_experts: int | None = None
    #: Whether the head reuses the input embeddings (None: config.json does not say).
    tie_word_embeddings: bool | None = None

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if isinstance(raw.get("text_config"), dict):  # multimodal wrappers keep the LM config here
            raw = {**raw["text_config"], "model_type": raw.get("model_type")}
        values = {"model_type": raw.get("model_type")}
        if values["model_type"] is not None and not isinstance(values["model_type"], str):
            raise ModelConfigError(f"{source}: model_type must be a string, got {values['model_type']!r}")
        aliases = {"num_experts": ("num_local_experts", "num_experts", "n_routed_experts")}
        tied = raw.get("tie_word_embeddings")
        if tied is not None and type(tied) is not bool:
            raise ModelConfigError(f"{source}: tie_word_embeddings must be true or false, got {tied!r}")
        values["tie_word_embeddings"] = tied
        for f in fields(cls):
            if f.name in values:
                continue
            value = next((raw[k] for k in aliases.get(f.name, (f.name,)) if raw.get(k) is not None), None)
            if value is not None and (type(value) is not int or value <= 0):
                raise ModelConfigError(f"{source}: {f.name} must be a positive integer, got {value!r}")
            values[f.name] = value
        if values["num_key_value_heads"] is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values["head_dim"] is None and values["hidden_size"] and values["num_attention_heads"]:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        return cls(**values)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's files (headers only, sorted by name) and its model config."""

    root: str
    files: tuple[FileHeader, ...]
    config: ModelConfig

    def tensors(self) -> Iterator[tuple[int, TensorInfo]]:
        """Every tensor with the index of the file that holds it."""
        for i, f in enumerate(self.files):
            for t in f.tensors:
                yield i, t

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.tensors())


def open_checkpoint(model_dir: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Discover the safetensors files of `model_dir` (a path or URI, or a model id in the local Hugging Face
    cache), validate their headers and read config.json; object storage is reached with `storage_options`."""
    model = resolve_model(model_dir)
    storage = storage_for(model, storage_options)
    path = storage.absolute(model)
    if storage.is_file(path):
        root, name = storage.split(path)
        names, weight_map = [name], None
    elif storage.is_dir(path):
        root = path
        names, weight_map = _discover(storage, root)
    else:
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    index = storage.join(root, INDEX_NAME) if weight_map is not None else None
    headers = tuple(_read_shard(storage, root, n, index, storage_options) for n in names)
    _cross_check(storage, root, names, headers, weight_map)
    return Checkpoint(root=root, files=headers, config=_read_config(storage, root))


def _discover(storage: Storage, root: str) -> tuple[list[str], dict[str, str] | None]:
    index = storage.join(root, INDEX_NAME)
    if storage.exists(index):
        weight_map = _read_index(storage, index)
        names = sorted(set(weight_map.values()))
        if not names:
            raise CheckpointNotFoundError(f"{index}: 'weight_map' names no tensors")
        return names, weight_map  # each shard's existence is checked as its header is read (`_read_shard`)
    if storage.is_file(storage.join(root, SINGLE_NAME)):
        return [SINGLE_NAME], None
    names = sorted(n for n in storage.list(root) if n.endswith(".safetensors") and storage.is_file(storage.join(root, n)))
    if not names:
        raise CheckpointNotFoundError(
            f"{root}: no {INDEX_NAME}, no {SINGLE_NAME} and no *.safetensors files; point raylazy at a model directory"
        )
    return names, None


def _read_shard(storage: Storage, root: str, name: str, index: str | None,
                storage_options: Mapping[str, Any] | None) -> FileHeader:
    """The header of shard `name`; one the index (`index`) names that is not a plain file is a MissingShardError.
    Checked only when opening it fails: a separate look-up first would cost object storage a second HEAD per shard."""
    path = storage.join(root, name)
    try:
        return read_header(path, storage_options)
    except (OSError, HeaderError):
        if index is not None and not storage.is_file(path):
            raise MissingShardError(f"{index}: shard {name!r} is not in {root}") from None
        raise


def _read_index(storage: Storage, index: str) -> dict[str, str]:
    try:
        raw = json.loads(_read_small(storage, index, IndexFileError).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8
        raise IndexFileError(f"{index}: not valid UTF-8 JSON: {str(e)[:200]}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise IndexFileError(f"{index}: 'weight_map' must be an object mapping tensor names to file names")
    for tensor, name in weight_map.items():
        if not _is_plain_name(name):
            raise UnsafePathError(
                f"{index}: tensor {tensor!r} maps to {name!r}, which is not a plain file name in the model "
                "directory (no directories, no '..', no absolute paths)"
            )
    return weight_map


def _is_plain_name(name: str) -> bool:
    return (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and os.path.basename(name) == name
    )


def _cross_check(storage: Storage, root: str, names: list[str], headers: tuple[FileHeader, ...], weight_map: dict | None) -> None:
    owner: dict[str, str] = {}
    for name, header in zip(names, headers):
        for t in header.tensors:
            if t.name in owner:
                raise DuplicateTensorError(f"{root}: tensor {t.name!r} appears in both {owner[t.name]} and {name}")
            owner[t.name] = name
    for tensor, name in (weight_map or {}).items():
        if owner.get(tensor) != name:
            raise MissingTensorError(
                f"{storage.join(root, INDEX_NAME)}: the index maps {tensor!r} to {name}, but "
                + (f"it is in {owner[tensor]}" if tensor in owner else "that file does not contain it")
            )


def _read_config(storage: Storage, root: str) -> ModelConfig:
    path = storage.join(root, "config.json")
    try:
        data = _read_small(storage, path, ModelConfigError)
    except ModelConfigError:  # no config.json (asked only now: object storage pays a HEAD per look-up)
        if not storage.is_file(path):
            return ModelConfig()
        raise
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ModelConfigError(f"{path}: not valid UTF-8 JSON: {str(e)[:200]}") from None
    return ModelConfig.from_dict(raw, path)


def _read_small(storage: Storage, path: str, error: type) -> bytes:
    """The bytes of a plain file of at most MAX_JSON_BYTES; a FIFO, device or directory (an index
    linked to /dev/zero would never end) or a larger file raises `error`."""
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
