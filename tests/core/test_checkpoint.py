"""Tests of raylazy.core.checkpoint: discovery of real transformers checkpoints, config.json
parsing, refusal of unsafe or inconsistent indexes, and the Hugging Face cache layout."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from raylazy.core.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint, ModelConfig
from raylazy.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    DuplicateTensorError,
    FileSizeMismatchError,
    IndexFileError,
    MissingShardError,
    MissingTensorError,
    ModelConfigError,
    UnsafePathError,
)
from raylazy.storage import open_checkpoint
from tests.support.checkpoints import (
    MODEL_FIXTURES,
    MODEL_SPECS,
    build_checkpoint,
    make_hf_cache,
    reference_tensors,
    shard_files,
)
from tests.support.planlib import as_bytes

# --- helpers --------------------------------------------------------------------


def copy_model(src: str, tmp_path, name: str = "model") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def load_index(model_dir: str) -> dict:
    with open(os.path.join(model_dir, INDEX_NAME)) as f:
        return json.load(f)


def save_index(model_dir: str, index) -> None:
    with open(os.path.join(model_dir, INDEX_NAME), "w") as f:
        json.dump(index, f)


def listing(ckpt: Checkpoint) -> dict[str, tuple[str, str, tuple[int, ...], bytes]]:
    """name -> (file name, dtype, shape, bytes read from the file at the header's offsets)."""
    out = {}
    for i, t in ckpt.tensors():
        path = ckpt.files[i].path
        with open(path, "rb") as f:
            f.seek(t.start)
            data = f.read(t.nbytes)
        assert t.name not in out
        out[t.name] = (os.path.basename(path), t.dtype, t.shape, data)
    return out


SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def assert_matches_reference(ckpt: Checkpoint, model_dir: str) -> None:
    """Every tensor safetensors reads from `model_dir` is listed, with its dtype, shape and bytes."""
    ref = reference_tensors(model_dir)
    ours = listing(ckpt)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        _, dtype, shape, data = ours[name]
        assert dtype == SAFETENSORS_DTYPE[t.dtype], name
        assert shape == tuple(t.shape), name
        assert data == as_bytes(t), name
    assert ckpt.nbytes == sum(t.numel() * t.element_size() for t in ref.values())


# --- real transformers checkpoints ----------------------------------------------------


def test_fixture_weights_are_random_and_distinct(model_dir):
    """The fixtures are only useful for bit-for-bit checks if no tensor is constant."""
    ref = reference_tensors(model_dir)
    seen = set()
    for name, t in ref.items():
        assert t.dtype == torch.bfloat16, name
        flat = t.float().reshape(-1)
        assert flat.numel() > 1 and not torch.all(flat == flat[0]), f"{name} is constant"
        digest = hashlib.sha256(as_bytes(t)).hexdigest()
        assert digest not in seen, f"{name} repeats another tensor"
        seen.add(digest)
    assert len(shard_files(model_dir)) >= 2


def test_open_sharded_checkpoint_lists_every_tensor(model_dir):
    ckpt = open_checkpoint(model_dir)
    assert ckpt.root == os.path.abspath(model_dir)
    assert [os.path.basename(f.path) for f in ckpt.files] == shard_files(model_dir)
    assert_matches_reference(ckpt, model_dir)


def test_tensors_are_in_the_files_the_index_names(model_dir):
    weight_map = load_index(model_dir)["weight_map"]
    ckpt = open_checkpoint(model_dir)
    assert {name: file for name, (file, *_) in listing(ckpt).items()} == weight_map


def test_open_accepts_pathlike(llama_dir):
    import pathlib

    assert open_checkpoint(pathlib.Path(llama_dir)) == open_checkpoint(llama_dir)


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_config_fields_from_real_configs(request, fixture):
    from transformers import AutoConfig

    model_dir = request.getfixturevalue(fixture)
    hf = AutoConfig.from_pretrained(model_dir)
    _, spec = MODEL_SPECS[fixture.removesuffix("_dir")]
    cfg = open_checkpoint(model_dir).config
    assert cfg.model_type == hf.model_type == fixture.removesuffix("_dir")
    assert cfg.hidden_size == hf.hidden_size == spec["hidden_size"]
    assert cfg.num_attention_heads == hf.num_attention_heads == spec["num_attention_heads"]
    assert cfg.num_key_value_heads == hf.num_key_value_heads == spec["num_key_value_heads"]
    expected_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert cfg.head_dim == expected_head_dim == spec.get("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    assert cfg.vocab_size == hf.vocab_size == spec["vocab_size"]
    assert cfg.num_hidden_layers == hf.num_hidden_layers == spec["num_hidden_layers"]
    assert cfg.intermediate_size == hf.intermediate_size == spec["intermediate_size"]
    assert cfg.num_experts == getattr(hf, "num_local_experts", None) == spec.get("num_local_experts")


def test_checkpoint_shape_agrees_with_config(model_dir):
    """Cross-check: the q/k/v projections written by transformers have the config's head counts."""
    ckpt = open_checkpoint(model_dir)
    cfg = ckpt.config
    shapes = {t.name: t.shape for _, t in ckpt.tensors()}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)
    assert shapes["model.embed_tokens.weight"] == (cfg.vocab_size, cfg.hidden_size)
    layers = {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")}
    assert layers == set(range(cfg.num_hidden_layers))


def test_single_model_safetensors(tmp_path, llama_dir):
    single = build_checkpoint("llama", tmp_path / "single", max_shard_size="1GB")
    assert shard_files(single) == [SINGLE_NAME] and not os.path.exists(os.path.join(single, INDEX_NAME))
    ckpt = open_checkpoint(single)
    assert [os.path.basename(f.path) for f in ckpt.files] == [SINGLE_NAME]
    assert_matches_reference(ckpt, single)
    # Same seed: the same tensors as the sharded fixture, bit for bit.
    sharded = {n: d for n, (_, _, _, d) in listing(open_checkpoint(llama_dir)).items()}
    assert {n: d for n, (_, _, _, d) in listing(ckpt).items()} == sharded
    assert ckpt.config == open_checkpoint(llama_dir).config


def test_model_safetensors_wins_over_other_files(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"a": torch.randn(3)}, str(d / SINGLE_NAME))
    save_file({"b": torch.randn(3)}, str(d / "consolidated.safetensors"))
    ckpt = open_checkpoint(d)
    assert [t.name for _, t in ckpt.tensors()] == ["a"]


def test_shards_without_index(tmp_path, qwen2_dir):
    d = copy_model(qwen2_dir, tmp_path)
    os.remove(os.path.join(d, INDEX_NAME))
    ckpt = open_checkpoint(d)
    assert [os.path.basename(f.path) for f in ckpt.files] == shard_files(qwen2_dir)
    assert_matches_reference(ckpt, d)
    assert ckpt.config == open_checkpoint(qwen2_dir).config


def test_arbitrary_safetensors_names_without_index(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    tensors = {"z.weight": torch.randn(4, 3), "a.bias": torch.randn(7).to(torch.float16), "m.x": torch.randn(2, 2)}
    save_file({"z.weight": tensors["z.weight"]}, str(d / "b.safetensors"))
    save_file({"a.bias": tensors["a.bias"], "m.x": tensors["m.x"]}, str(d / "a.safetensors"))
    (d / "notes.txt").write_text("not a shard")
    (d / "dir.safetensors").mkdir()  # a directory with the suffix is not a shard
    ckpt = open_checkpoint(d)
    assert [os.path.basename(f.path) for f in ckpt.files] == ["a.safetensors", "b.safetensors"]
    assert ckpt.config == ModelConfig()  # no config.json
    got = listing(ckpt)
    for name, t in tensors.items():
        assert got[name][3] == as_bytes(t)


def test_path_to_one_file(mixtral_dir):
    files = shard_files(mixtral_dir)
    path = os.path.join(mixtral_dir, files[1])
    ckpt = open_checkpoint(path)
    assert ckpt.root == os.path.abspath(mixtral_dir)
    assert [f.path for f in ckpt.files] == [os.path.abspath(path)]
    with safe_open(path, framework="pt") as f:
        expected = {k: f.get_tensor(k) for k in f.keys()}
    got = listing(ckpt)
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name][3] == as_bytes(t)
    # The config next to the file is read.
    assert ckpt.config == open_checkpoint(mixtral_dir).config
    assert ckpt.config.num_experts == MODEL_SPECS["mixtral"][1]["num_local_experts"]


# --- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "../x.safetensors",
        "..",
        ".",
        "",
        "/abs/path.safetensors",
        "sub/dir.safetensors",
        "sub\\dir.safetensors",
        "./model-00001-of-00003.safetensors",
        "a\x00.safetensors",
    ],
)
def test_index_entry_outside_the_directory(tmp_path, llama_dir, bad):
    d = copy_model(llama_dir, tmp_path)
    index = load_index(d)
    victim = sorted(index["weight_map"])[3]
    index["weight_map"][victim] = bad
    save_index(d, index)
    with pytest.raises(UnsafePathError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, INDEX_NAME, repr(victim), repr(bad))


def test_traversal_refused_even_when_the_target_exists(tmp_path, llama_dir):
    """`../x.safetensors` names a real, valid file: still refused, never opened."""
    d = copy_model(llama_dir, tmp_path, "inner")
    outside = tmp_path / "x.safetensors"
    save_file({"ghost": torch.randn(2)}, str(outside))
    index = load_index(d)
    index["weight_map"]["ghost"] = "../x.safetensors"
    save_index(d, index)
    with pytest.raises(UnsafePathError):
        open_checkpoint(d)


def test_missing_shard(tmp_path, mixtral_dir):
    d = copy_model(mixtral_dir, tmp_path)
    gone = shard_files(d)[2]
    os.remove(os.path.join(d, gone))
    with pytest.raises(MissingShardError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, repr(gone), d)


def test_dangling_symlink_shard_is_missing(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path)
    name = shard_files(d)[0]
    os.remove(os.path.join(d, name))
    os.symlink(str(tmp_path / "nowhere.safetensors"), os.path.join(d, name))
    with pytest.raises(MissingShardError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, repr(name))


def test_index_names_a_tensor_its_file_lacks(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path)
    index = load_index(d)
    target = shard_files(d)[1]
    index["weight_map"]["model.layers.9.ghost.weight"] = target
    save_index(d, index)
    with pytest.raises(MissingTensorError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, "'model.layers.9.ghost.weight'", target, "does not contain it")


def test_index_maps_a_tensor_to_the_wrong_file(tmp_path, qwen2_dir):
    d = copy_model(qwen2_dir, tmp_path)
    index = load_index(d)
    files = shard_files(d)
    name = next(n for n, f in sorted(index["weight_map"].items()) if f == files[0])
    index["weight_map"][name] = files[1]
    save_index(d, index)
    with pytest.raises(MissingTensorError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, repr(name), files[1], f"it is in {files[0]}")


def _add_tensor_to_shard(path: str, name: str, t: torch.Tensor) -> None:
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    tensors[name] = t
    save_file(tensors, path, metadata=metadata)


def test_tensor_in_two_files_with_index(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path)
    files = shard_files(d)
    ref = reference_tensors(d)
    index = load_index(d)
    name = next(n for n, f in sorted(index["weight_map"].items()) if f == files[0])
    _add_tensor_to_shard(os.path.join(d, files[-1]), name, ref[name])
    with pytest.raises(DuplicateTensorError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, repr(name), files[0], files[-1])


def test_tensor_in_two_files_without_index(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    save_file({"w": torch.randn(2), "u": torch.randn(3)}, str(d / "a.safetensors"))
    save_file({"v": torch.randn(2), "w": torch.randn(2)}, str(d / "b.safetensors"))
    with pytest.raises(DuplicateTensorError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, "'w'", "a.safetensors", "b.safetensors")


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"",
        b'{"weight_map": {"a": "b.safetensors",}}',
        b"\xff\xfe{}",
        b"[]",
        b'"weight_map"',
        b"{}",
        b'{"metadata": {}}',
        b'{"weight_map": []}',
        b'{"weight_map": null}',
        b'{"weight_map": {"a": 3}}',
        b'{"weight_map": {"a": null}}',
        b'{"weight_map": {"a": ["model.safetensors"]}}',
    ],
    ids=[
        "truncated",
        "empty",
        "trailing-comma",
        "utf16-bom",
        "list",
        "string",
        "no-weight-map",
        "metadata-only",
        "weight-map-list",
        "weight-map-null",
        "int-file",
        "null-file",
        "list-file",
    ],
)
def test_bad_index(tmp_path, llama_dir, content):
    d = copy_model(llama_dir, tmp_path)
    with open(os.path.join(d, INDEX_NAME), "wb") as f:
        f.write(content)
    with pytest.raises(IndexFileError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, os.path.join(d, INDEX_NAME))


def test_index_with_empty_weight_map(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path)
    with open(os.path.join(d, INDEX_NAME), "w") as f:
        f.write('{"metadata": {}, "weight_map": {}}')
    with pytest.raises(CheckpointNotFoundError, match="names no tensors"):
        open_checkpoint(d)


def test_empty_directory(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(CheckpointNotFoundError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, str(d))


def test_directory_without_weights(tmp_path, llama_dir):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(os.path.join(llama_dir, "config.json"), d)
    (d / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(d)


def test_nonexistent_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError) as info:
        open_checkpoint(tmp_path / "nope")
    assert_mentions(info.value, str(tmp_path / "nope"))


def test_corrupt_shard_is_a_header_error(tmp_path, llama_dir):
    d = copy_model(llama_dir, tmp_path)
    shard = os.path.join(d, shard_files(d)[1])
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(FileSizeMismatchError) as info:
        open_checkpoint(d)
    assert info.value.path == shard


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_attention_heads", "8"),
        ("num_key_value_heads", 2.0),
        ("hidden_size", True),
        ("head_dim", -8),
        ("vocab_size", 0),
        ("num_hidden_layers", [2]),
        ("intermediate_size", {"x": 1}),
        ("num_local_experts", "4"),
        ("model_type", 7),
    ],
)
def test_config_with_wrong_types(tmp_path, mixtral_dir, field, value):
    d = copy_model(mixtral_dir, tmp_path)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw[field] = value
    with open(path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ModelConfigError) as info:
        open_checkpoint(d)
    shown = "num_experts" if field == "num_local_experts" else field
    assert_mentions(info.value, path, shown, repr(value))


@pytest.mark.parametrize("content", [b"{", b"[1, 2]", b"\xff", b'"llama"'])
def test_config_not_an_object(tmp_path, llama_dir, content):
    d = copy_model(llama_dir, tmp_path)
    with open(os.path.join(d, "config.json"), "wb") as f:
        f.write(content)
    with pytest.raises(ModelConfigError) as info:
        open_checkpoint(d)
    assert_mentions(info.value, "config.json")


def test_config_defaults_and_aliases():
    cfg = ModelConfig.from_dict({"model_type": "x", "hidden_size": 96, "num_attention_heads": 12, "n_routed_experts": 8})
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.num_experts) == (12, 8, 8)
    wrapped = ModelConfig.from_dict({"model_type": "vlm", "text_config": {"hidden_size": 32, "num_attention_heads": 4}})
    assert (wrapped.model_type, wrapped.hidden_size, wrapped.head_dim) == ("vlm", 32, 8)
    assert ModelConfig.from_dict({}) == ModelConfig()


def test_all_refusals_are_checkpoint_errors():
    for cls in (
        CheckpointNotFoundError,
        UnsafePathError,
        MissingShardError,
        MissingTensorError,
        DuplicateTensorError,
        IndexFileError,
        ModelConfigError,
    ):
        assert issubclass(cls, CheckpointError)


# --- Hugging Face cache layout ---------------------------------------------------------


def test_hf_cache_layout(tmp_path, llama_dir):
    snap = make_hf_cache(llama_dir, str(tmp_path / "hub"))
    assert all(os.path.islink(os.path.join(snap, n)) for n in os.listdir(snap))
    ckpt = open_checkpoint(snap)
    assert ckpt.root == snap
    # Paths stay in the snapshot (as listed), not in blobs/.
    assert [os.path.basename(f.path) for f in ckpt.files] == shard_files(llama_dir)
    assert all(os.path.dirname(f.path) == snap for f in ckpt.files)
    assert_matches_reference(ckpt, snap)
    assert ckpt.config == open_checkpoint(llama_dir).config


def test_hf_cache_layout_without_index_and_single_file(tmp_path, mixtral_dir):
    snap = make_hf_cache(mixtral_dir, str(tmp_path / "hub"))
    os.remove(os.path.join(snap, INDEX_NAME))
    assert_matches_reference(open_checkpoint(snap), snap)
    one = os.path.join(snap, shard_files(snap)[0])
    ckpt = open_checkpoint(one)
    assert [f.path for f in ckpt.files] == [one]


def test_hf_cache_layout_through_refs_symlinked_dir(tmp_path, qwen2_dir):
    snap = make_hf_cache(qwen2_dir, str(tmp_path / "hub"))
    link = str(tmp_path / "model")
    os.symlink(snap, link)  # a symlinked model directory
    ckpt = open_checkpoint(link)
    assert_matches_reference(ckpt, link)


# --- small helpers -----------------------------------------------------------------


def assert_mentions(err: Exception, *needles) -> None:
    msg = str(err)
    for needle in needles:
        assert str(needle) in msg, f"{needle!r} not in message: {msg}"
