"""A checkpoint as data: its files' headers, its model config, and the parsing and checks of its index and
config.json (bytes in, data out; finding and reading the files is `raylazy.storage.open_checkpoint`).

A model directory is one of: a single `model.safetensors`; a
`model.safetensors.index.json` and the shards its `weight_map` names (as
transformers' `save_pretrained` writes them); or a set of `*.safetensors` files.
Shards must be plain file names inside the directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..errors import DuplicateTensorError, IndexFileError, MissingTensorError, ModelConfigError, UnsafePathError
from .header import FileHeader, TensorInfo

if TYPE_CHECKING:
    from .quantization import Format

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
    #: Multi-token-prediction layers after the last decoder layer (DeepSeek-V3's layer 61; 0: none).
    num_nextn_predict_layers: int = 0
    #: The format of `quantization_config` (None: not quantized), `raylazy.core.quantization`.
    quantization: Format | None = None

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if isinstance(raw.get("text_config"), dict):  # multimodal wrappers keep the LM config here
            raw = {"quantization_config": raw.get("quantization_config"), **raw["text_config"],
                   "model_type": raw.get("model_type")}
        values = {"model_type": raw.get("model_type")}
        if values["model_type"] is not None and not isinstance(values["model_type"], str):
            raise ModelConfigError(f"{source}: model_type must be a string, got {values['model_type']!r}")
        aliases = {  # other names config.json uses for them (transformers' attribute_map of the config class)
            "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
            "num_attention_heads": ("num_attention_heads", "n_head"),
            "hidden_size": ("hidden_size", "n_embd"),
            "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
        }
        tied = raw.get("tie_word_embeddings")
        if tied is not None and type(tied) is not bool:
            raise ModelConfigError(f"{source}: tie_word_embeddings must be true or false, got {tied!r}")
        values["tie_word_embeddings"] = tied
        mtp = raw.get("num_nextn_predict_layers") or 0
        if type(mtp) is not int or mtp < 0:
            raise ModelConfigError(f"{source}: num_nextn_predict_layers must be a non-negative integer, got {mtp!r}")
        values["num_nextn_predict_layers"] = mtp
        if raw.get("quantization_config") is not None:
            from .quantization import parse_quantization  # its formats' modules, for a quantized checkpoint only

            values["quantization"] = parse_quantization(raw["quantization_config"], source)
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
        """Bytes of tensor data: each file's data section (headers check that its tensors fill it exactly)."""
        return sum(f.file_size - f.data_start for f in self.files)


def parse_index(data: bytes, index: str) -> dict[str, str]:
    """The `weight_map` of index file `index` (its bytes `data`): tensor name -> shard file name, each a plain
    name inside the model directory."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8
        raise IndexFileError(f"{index}: not valid UTF-8 JSON: {str(e)[:200]}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or set(map(type, weight_map)) - {str} or set(map(type, weight_map.values())) - {str}:
        raise IndexFileError(f"{index}: 'weight_map' must be an object mapping tensor names to file names")
    if not all(map(_is_plain_name, set(weight_map.values()))):  # each file name once: an index names ~10^5 tensors
        tensor, name = next((t, n) for t, n in weight_map.items() if not _is_plain_name(n))
        raise UnsafePathError(
            f"{index}: tensor {tensor!r} maps to {name!r}, which is not a plain file name in the model "
            "directory (no directories, no '..', no absolute paths)"
        )
    return weight_map


def parse_config(data: bytes, path: str) -> ModelConfig:
    """The ModelConfig of config.json `path` (its bytes `data`)."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ModelConfigError(f"{path}: not valid UTF-8 JSON: {str(e)[:200]}") from None
    return ModelConfig.from_dict(raw, path)


def _is_plain_name(name: str) -> bool:
    return (
        name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and os.path.basename(name) == name
    )


def cross_check(root: str, index: str, names: list[str], headers: tuple[FileHeader, ...],
                weight_map: dict | None) -> None:
    """DuplicateTensorError for a tensor in two files of `root`; MissingTensorError for an entry of index file
    `index` naming a file that does not hold the tensor."""
    owner = {t.name: name for name, header in zip(names, headers) for t in header.tensors}
    if len(owner) != sum(len(h.tensors) for h in headers):  # a tensor in two files: name the first
        seen: dict[str, str] = {}
        for name, header in zip(names, headers):
            for t in header.tensors:
                if t.name in seen:
                    raise DuplicateTensorError(f"{root}: tensor {t.name!r} appears in both {seen[t.name]} and {name}")
                seen[t.name] = name
    if not weight_map or weight_map.items() <= owner.items():
        return
    for tensor, name in weight_map.items():
        if owner.get(tensor) != name:
            raise MissingTensorError(
                f"{index}: the index maps {tensor!r} to {name}, but "
                + (f"it is in {owner[tensor]}" if tensor in owner else "that file does not contain it")
            )
